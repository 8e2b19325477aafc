"""Environment flags and options resolve in one place, with one-line errors for bad values."""
import pytest

from dflash.core import settings
from dflash.core.errors import UsageError


def test_defaults_are_q1_with_upstream_ceiling():
    s = settings.resolve({})
    assert (s.bands, s.cap, s.mmvq_max_ncols, s.lib) == (False, 1, 3, "exact")


@pytest.mark.parametrize("val,on", [("1", True), ("true", True), ("YES", True), ("on", True),
                                    ("0", False), ("false", False), ("no", False), ("Off", False)])
def test_bool_spellings(val, on):
    s = settings.resolve({settings.ENV_BANDS: val})
    assert s.bands is on and s.bands_from == "env"


def test_bands_on_defaults():
    s = settings.resolve({settings.ENV_BANDS: "1"})
    assert (s.cap, s.mmvq_max_ncols) == (4, 4)


def test_option_overrides_env():
    assert settings.resolve({settings.ENV_BANDS: "1"}, bands=False).bands is False
    assert settings.resolve({settings.ENV_BANDS: "0"}, bands=True).bands is True


@pytest.mark.parametrize("val,ncols", [("2", 2), ("0", 8), ("-3", 8), ("6", 6)])
def test_mmvq_ceiling(val, ncols):
    assert settings.resolve({settings.ENV_MMVQ: val, settings.ENV_BANDS: "1"}).mmvq_max_ncols == ncols


def test_band_wider_than_ceiling_warns():
    s = settings.resolve({settings.ENV_MMVQ: "2"}, bands=True, chunk=4)
    assert s.leaves_narrow_path and "leave the narrow exact path" in s.warnings()[0]
    assert not settings.resolve({}, bands=True, chunk=4).warnings()


@pytest.mark.parametrize("env,name", [({settings.ENV_BANDS: "maybe"}, settings.ENV_BANDS),
                                      ({settings.ENV_MMVQ: "abc"}, settings.ENV_MMVQ)])
def test_malformed_env_names_the_variable(env, name):
    with pytest.raises(UsageError, match=name):
        settings.resolve(env)


@pytest.mark.parametrize("chunk", [0, 5, 9, -1])
def test_chunk_range_in_band_mode(chunk):
    with pytest.raises(UsageError, match="^chunk"):
        settings.resolve({}, bands=True, chunk=chunk)


def test_unknown_lib():
    with pytest.raises(UsageError, match="^lib"):
        settings.resolve({}, lib="fast")


def test_ceiling_above_eight_is_eight_like_the_hip_library():
    assert settings.resolve({settings.ENV_MMVQ: "12"}).mmvq_max_ncols == 8


def test_raw_flags_are_kept_and_effective_ones_exported():
    s = settings.resolve({settings.ENV_BANDS: "yes", settings.ENV_MMVQ: "0", "UNRELATED": "x"})
    assert dict(s.env_raw) == {settings.ENV_BANDS: "yes", settings.ENV_MMVQ: "0"}
    assert s.library_env() == {settings.ENV_MMVQ: "8", settings.ENV_NARROW: "1", settings.ENV_SHORTCUT: "1",
                                settings.ENV_TILE: "0", settings.ENV_WINDOW: "1"}


def test_verbose_and_debug_flags():
    assert settings.resolve({settings.ENV_VERBOSE: "on"}).verbose and not settings.resolve({}).verbose
    assert settings.debug_flag({settings.ENV_DEBUG: "1"}) and not settings.debug_flag({settings.ENV_DEBUG: "false"})
    assert not settings.debug_flag({})


@pytest.mark.parametrize("raw,mode,exported", [
    (None, "on", "1"), ("", "on", "1"), ("1", "on", "1"), ("off", "off", "0"), ("0", "off", "0"),
    ("force", "force", "force"), (" FORCE ", "force", "force")])
def test_the_indexer_shortcut_flag(raw, mode, exported):
    env = {} if raw is None else {settings.ENV_SHORTCUT: raw}
    s = settings.resolve(env)
    assert s.indexer_shortcut == mode and s.library_env()[settings.ENV_SHORTCUT] == exported


@pytest.mark.parametrize("raw,mode,exported", [
    (None, "on", "1"), ("", "on", "1"), ("yes", "on", "1"), ("off", "off", "0"), ("0", "off", "0"),
    ("plant", "plant", "plant"), (" Plant ", "plant", "plant")])
def test_the_raw_window_flag(raw, mode, exported):
    env = {} if raw is None else {settings.ENV_WINDOW: raw}
    s = settings.resolve(env)
    assert s.raw_window == mode and s.library_env()[settings.ENV_WINDOW] == exported
    with pytest.raises(UsageError, match=settings.ENV_WINDOW):
        settings.resolve({settings.ENV_WINDOW: "narrow"})


def test_a_malformed_indexer_shortcut_flag_is_a_usage_error():
    with pytest.raises(UsageError, match=settings.ENV_SHORTCUT):
        settings.resolve({settings.ENV_SHORTCUT: "sometimes"})
