"""Environment flags and options resolve in one place, with one-line errors for bad values."""
import pytest

from dflash import settings as S
from dflash.errors import UsageError


def test_defaults_are_q1_with_upstream_ceiling():
    s = S.resolve({})
    assert (s.bands, s.cap, s.mmvq_max_ncols, s.lib) == (False, 1, 3, "exact")


@pytest.mark.parametrize("val,on", [("1", True), ("true", True), ("YES", True), ("on", True),
                                    ("0", False), ("false", False), ("no", False), ("Off", False)])
def test_bool_spellings(val, on):
    s = S.resolve({S.ENV_BANDS: val})
    assert s.bands is on and s.bands_from == "env"


def test_bands_on_defaults():
    s = S.resolve({S.ENV_BANDS: "1"})
    assert (s.cap, s.mmvq_max_ncols) == (4, 4)


def test_option_overrides_env():
    assert S.resolve({S.ENV_BANDS: "1"}, bands=False).bands is False
    assert S.resolve({S.ENV_BANDS: "0"}, bands=True).bands is True


@pytest.mark.parametrize("val,ncols", [("2", 2), ("0", 8), ("-3", 8), ("6", 6)])
def test_mmvq_ceiling(val, ncols):
    assert S.resolve({S.ENV_MMVQ: val, S.ENV_BANDS: "1"}).mmvq_max_ncols == ncols


def test_band_wider_than_ceiling_warns():
    s = S.resolve({S.ENV_MMVQ: "2"}, bands=True, chunk=4)
    assert s.leaves_narrow_path and "leave the narrow exact path" in s.warnings()[0]
    assert not S.resolve({}, bands=True, chunk=4).warnings()


@pytest.mark.parametrize("env,name", [({S.ENV_BANDS: "maybe"}, S.ENV_BANDS),
                                      ({S.ENV_MMVQ: "abc"}, S.ENV_MMVQ)])
def test_malformed_env_names_the_variable(env, name):
    with pytest.raises(UsageError, match=name):
        S.resolve(env)


@pytest.mark.parametrize("chunk", [0, 5, 9, -1])
def test_chunk_range_in_band_mode(chunk):
    with pytest.raises(UsageError, match="--chunk"):
        S.resolve({}, bands=True, chunk=chunk)


def test_unknown_lib():
    with pytest.raises(UsageError, match="--lib"):
        S.resolve({}, lib="fast")


def test_ceiling_above_eight_is_eight_like_the_hip_library():
    assert S.resolve({S.ENV_MMVQ: "12"}).mmvq_max_ncols == 8


def test_raw_flags_are_kept_and_effective_ones_exported():
    s = S.resolve({S.ENV_BANDS: "yes", S.ENV_MMVQ: "0", "UNRELATED": "x"})
    assert dict(s.env_raw) == {S.ENV_BANDS: "yes", S.ENV_MMVQ: "0"}
    assert s.library_env() == {S.ENV_MMVQ: "8"}


def test_verbose_and_debug_flags():
    assert S.resolve({S.ENV_VERBOSE: "on"}).verbose and not S.resolve({}).verbose
    assert S.debug_flag({S.ENV_DEBUG: "1"}) and not S.debug_flag({S.ENV_DEBUG: "false"})
    assert not S.debug_flag({})
