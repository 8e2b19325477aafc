"""The pure parts of serving: llama-server's options, the refusals, the serve record, the workload
and the comparison of responses (no server runs here; tests/test_serve.py runs real ones)."""
import json

import pytest

from dflash.core.errors import UsageError
from dflash.native import build
from dflash.serving import serve_config, serve_record
from dflash.serving import serve_workload as wl
from dflash.serving.serve_check import Prefilled, compare

CFG = serve_config.ServeConfig(parallel=4, ubatch=512, ctx=1024, threads=2)


def test_args_pin_what_keeps_it_exact():
    a = CFG.args()
    assert a[a.index("-np") + 1] == "4" and a[a.index("-c") + 1] == str(4 * 1024)
    assert a[a.index("-b") + 1] == a[a.index("-ub") + 1] == "512"
    assert a[a.index("-t") + 1] == a[a.index("-tb") + 1] == "2"
    for flag in ("--swa-full", "--no-kv-unified", "--no-context-shift"):
        assert flag in a
    assert a[a.index("--cache-reuse") + 1] == "0" and a[a.index("-fa") + 1] == "auto"
    assert "--kv-unified" in serve_config.ServeConfig(1, 1, 64, 1, kv_unified=True).args()


def test_one_token_ubatches_keep_a_logical_batch_llama_server_starts_with():
    # llama-server decodes a 2-token batch at start (common_context_can_seq_rm) and aborts with -b 1
    a = serve_config.ServeConfig(1, 1, 64, 1).args()
    assert a[a.index("-ub") + 1] == "1" and a[a.index("-b") + 1] == "2"
    a = serve_config.ServeConfig(1, 2, 64, 1).args()
    assert a[a.index("-ub") + 1] == a[a.index("-b") + 1] == "2"


@pytest.mark.parametrize("kw, word", [({"parallel": 0}, "parallel"), ({"ubatch": 4097}, "ubatch"),
                                      ({"ctx": 8}, "ctx"), ({"threads": 0}, "threads"),
                                      ({"flash_attn": "maybe"}, "flash")])
def test_config_refuses_bad_values(kw, word):
    with pytest.raises(UsageError, match=word):
        serve_config.ServeConfig(**{"parallel": 1, "ubatch": 1, "ctx": 64, "threads": 1, **kw})


def test_vouching_ignores_ctx_and_threads_only():
    base = serve_config.ServeConfig(4, 64, 1024, 2)
    assert base.vouched_by(serve_config.ServeConfig(4, 64, 99999, 7))
    cfg = serve_config.ServeConfig
    for other in (cfg(2, 64, 1024, 2), cfg(4, 32, 1024, 2), cfg(4, 64, 1024, 2, kv_unified=True),
                  cfg(4, 64, 1024, 2, "off")):
        assert not base.vouched_by(other)


def test_a_vulkan_device_puts_every_layer_on_it_with_flash_attention_and_without_op_offload():
    assert serve_config.device_args("cpu", "exact") == [] and serve_config.flash_attn_for("cpu", "exact") == "auto"
    a = serve_config.device_args("vulkan:1", "exact")  # the server is shown vulkan:1 alone: its Vulkan0
    assert a[a.index("-dev") + 1] == "Vulkan0" and a[a.index("-ngl") + 1] == "999" and "--no-op-offload" in a
    assert serve_config.flash_attn_for("vulkan:1", "exact") == "on"  # the exact flavor's own (patch 0012)
    assert serve_config.flash_attn_for("cuda:0", "exact") == serve_config.flash_attn_for("hip:0", "exact") == "off"
    assert "--no-op-offload" not in serve_config.device_args("vulkan:0", "stock")  # stock: llama.cpp's defaults
    assert serve_config.flash_attn_for("vulkan:0", "stock") == "auto"


def test_the_fingerprint_names_a_gpu_and_its_driver_and_leaves_cpu_ones_as_they_were():
    cpu = serve_config.fingerprint("exact", "k" * 16, "s" * 64, "m" * 64)
    assert cpu == serve_config.fingerprint("exact", "k" * 16, "s" * 64, "m" * 64, "cpu")
    assert cpu == f"dflash-exact-{'k' * 16}-server-{'s' * 8}-model-{'m' * 16}"
    lvp = serve_config.fingerprint("exact", "k" * 16, "s" * 64, "m" * 64, "vulkan:0 llvmpipe / llvmpipe Mesa 22.3.6")
    radv = serve_config.fingerprint("exact", "k" * 16, "s" * 64, "m" * 64, "vulkan:0 AMD Radeon / radv Mesa 25.0.7")
    assert "-vulkan0-" in lvp and lvp != radv and lvp != cpu


@pytest.mark.parametrize("option", ["--no-op-offload", "--op-offload", "-dev", "-ngl"])
def test_placement_options_are_dflashs(option):
    with pytest.raises(UsageError, match="--device"):
        serve_config.check_extra([option], allow_inexact=True)


@pytest.mark.parametrize("extra, word", [(["-np", "8"], "--parallel"), (["--ubatch-size=32"], "--ubatch"),
                                         (["--kv-unified"], "pins"), (["--api-key", "k"], "--api-key"),
                                         (["-m", "x.gguf"], "--model"), (["--port", "1"], "--port")])
def test_managed_options_are_refused_even_with_allow_inexact(extra, word):
    with pytest.raises(UsageError, match=word):
        serve_config.check_extra(extra, allow_inexact=True)


@pytest.mark.parametrize("extra", [["--cache-reuse", "256"], ["--cache-reuse=16"], ["-ctk", "q8_0"],
                                   ["--lora", "a.gguf"], ["--rope-freq-base", "1e6"], ["--spec-synth-len", "2"]])
def test_inexact_options_need_allow_inexact(extra):
    with pytest.raises(UsageError, match="breaks exactness.*--allow-inexact"):
        serve_config.check_extra(extra, allow_inexact=False)
    warnings = serve_config.check_extra(extra, allow_inexact=True)
    assert len(warnings) == 1 and extra[0].split("=")[0] in warnings[0]


def test_harmless_options_pass():
    assert serve_config.check_extra(["--cache-reuse", "0", "--chat-template", "chatml", "--metrics", "-n", "-1",
                                "--temp", "-0.5", "--slot-prompt-similarity", "0.1"], allow_inexact=False) == []


def test_bind_address_needs_both_remote_flags():
    assert serve_config.bind_address("127.0.0.1", False, None) == ("127.0.0.1", None)
    assert serve_config.bind_address("127.5.0.1", False, None)[1] is None
    for allow, key, missing in ((False, None, "--allow-remote and --api-key"), (True, None, "--api-key"),
                                (False, "k", "--allow-remote")):
        with pytest.raises(UsageError, match=missing):
            serve_config.bind_address("10.1.2.3", allow, key)
    host, warning = serve_config.bind_address("10.1.2.3", True, "k")
    assert host == "10.1.2.3" and "not encrypted" in warning
    with pytest.raises(UsageError, match="not an IP address"):
        serve_config.bind_address("example.org", True, "k")


def test_fingerprint_names_flavor_builds_and_model():
    fp = serve_config.fingerprint("exact", "0123456789abcdef", "fedcba9876543210", "ab" * 32)
    assert fp == "dflash-exact-0123456789abcdef-server-fedcba98-model-abababababababab"


def test_server_key_covers_the_server_build_and_library_keys_do_not(tmp_path, monkeypatch):
    import shutil
    for rel in ("CMakeLists.txt", "cmake", "cpu_kernels/patches", "rpc/patches", "server"):
        src, dst = build.SOURCE_ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)
    monkeypatch.setattr(build, "SOURCE_ROOT", tmp_path)
    keys = (build.build_key("exact"), build.build_key("stock"), build.server_key())
    patch = next((tmp_path / "server" / "patches").glob("*.patch"))
    patch.write_text(patch.read_text() + "\n")
    assert (build.build_key("exact"), build.build_key("stock")) == keys[:2]  # a server edit rebuilds no library
    after = build.server_key()
    assert after != keys[2]
    (tmp_path / "server" / "README.md").write_text("docs are no build input\n")
    assert build.server_key() == after
    kernel = next((tmp_path / "cpu_kernels" / "patches" / "exact").glob("*.patch"))
    kernel.write_text(kernel.read_text() + "\n")
    assert build.build_key("exact") != keys[0] and build.server_key() != after  # it links the exact library


# ---- the serve record ------------------------------------------------------------------------

IDENT = serve_record.Identity("exact", "0123456789abcdef", "cd" * 32, "cpu")


def _entry(exact=True, n=10, solo=10, pre=10):
    return serve_record.Entry(CFG, n, solo, pre, 3, exact, "/ev")


def test_record_round_trip_and_merge(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    serve_record.save(IDENT, "/m.gguf", [_entry()])
    other = serve_record.Entry(serve_config.ServeConfig(1, 512, 1024, 2), 10, 10, 10, 3, True, "/ev2")
    rec = serve_record.save(IDENT, "/m.gguf", [other, _entry(exact=False, solo=9)])
    assert serve_record.load(IDENT) == rec
    assert [e.config.parallel for e in rec.configs] == [1, 4] and not rec.configs[1].exact
    assert serve_record.find(rec, serve_config.ServeConfig(4, 512, 4096, 8)) is None  # the failed entry replaced it
    assert serve_record.find(rec, serve_config.ServeConfig(1, 512, 4096, 8)) == other


@pytest.mark.parametrize("mutate, word", [
    (lambda d: d.update(key="0" * 24), "key does not match"),
    (lambda d: d["configs"][0].update(identical_to_solo=9), "marked exact"),
    (lambda d: d["configs"][0].update(responses=-1), "not a count"),
    (lambda d: d["configs"][0]["config"].update(parallel=0), "parallel"),
    (lambda d: d["configs"][0]["config"].update(ubatch="512"), "wrong types"),
    (lambda d: d.update(extra=1), "unknown"),
    (lambda d: d.update(schema="dflash.qualification"), "not a dflash.serve-qualification"),
])
def test_record_reader_is_strict(mutate, word):
    d = serve_record.Record(IDENT, "/m.gguf", "2026-01-01T00:00:00Z", (_entry(),)).to_json()
    serve_record.parse(json.dumps(d).encode())  # the unmodified record reads
    mutate(d)
    with pytest.raises(serve_record.RecordError, match=word):
        serve_record.parse(json.dumps(d).encode())


def test_corrupt_record_is_an_error_for_load(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = serve_record.record_path(IDENT)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"{not json")
    with pytest.raises(serve_record.RecordError, match="not valid JSON"):
        serve_record.load(IDENT)
    assert serve_record.save(IDENT, "/m", [_entry()]).configs == (_entry(),)  # a new run replaces it


# ---- the workload and the comparison -----------------------------------------------------------

def test_workload_clients_share_a_prefix_and_follow_up_on_the_cache():
    shape = wl.Shape(prefix_words=50, max_tokens=4, chat=True)
    cs = wl.clients(shape)
    assert wl.words(50, 1) == wl.words(50, 1) != wl.words(50, 2)
    firsts = [c.first for c in cs]
    shared = [c for c in firsts if c.name.startswith("shared")]
    assert len(shared) == 3 and all(c.body["prompt"].startswith(wl.words(50, 1) + " ") for c in shared)
    assert {c.stream for c in firsts} == {True, False} and {c.endpoint for c in firsts} == {wl.COMPLETIONS, wl.CHAT}
    assert len({c.delay for c in cs}) == len(cs)  # arrivals spread out
    follow = {c.first.name: c.then[0](c.first, wl.Response(c.first.name, 200, text=f"reply to {c.first.name}"))
              for c in cs if c.then}
    again = follow["shared-0"]
    assert again.key() == cs[0].first.key() and again.stream != cs[0].first.stream and again.wave == 1
    sib = follow["shared-1"].body["prompt"]
    assert sib.startswith(wl.words(50, 1) + " ") and sib != cs[1].first.body["prompt"]
    turn2 = follow["chat-0"].body["messages"]
    assert turn2[0]["role"] == "system" and turn2[2] == {"role": "assistant", "content": "reply to chat-0"}
    assert follow["chat-1"].body["messages"][0] == cs[-1].first.body["messages"][0]  # same system prompt
    assert all(c.body["temperature"] == 0 for c in [*firsts, *follow.values()])
    assert not any(c.first.endpoint == wl.CHAT for c in wl.clients(wl.Shape(chat=False)))


def _resp(name, tokens=(5, 6), lp=-0.5, logits="a" * 64, prompt="b" * 64, cached=0):
    return wl.Response(name, 200, tuple(tokens), tuple((t, lp, ((t, lp),)) for t in tokens), "x", logits, prompt,
                       "c" * 64, "fp", 10, cached)


def test_compare_finds_every_kind_of_difference():
    calls = [wl.Call(f"c{i}", wl.COMPLETIONS, {"prompt": f"p{i}", "max_tokens": 2}) for i in range(6)]
    solo = {c.key(): _resp(c.name) for c in calls}
    pre = {c.key(): Prefilled("b" * 64, "a" * 64, (5, 6)) for c in calls}
    got = [_resp("c0", cached=7), _resp("c1", tokens=(5, 7)), _resp("c2", lp=-0.25), _resp("c3", logits="d" * 64),
           wl.Response("c4", 500, error="boom"), _resp("c5", prompt="e" * 64)]
    v = compare(calls, got, solo, pre)
    assert (v[0].solo, v[0].prefill, v[0].cached_tokens, v[0].why) == (True, True, 7, "")
    assert not v[1].solo and not v[1].prefill and "token ids differ from the solo" in v[1].why
    assert not v[2].solo and v[2].prefill and v[2].why == "logprobs differ from the solo cold run"
    assert not v[3].solo and not v[3].prefill and "last-position logits differ from dflash prefill" in v[3].why
    assert not v[4].solo and not v[4].prefill and "HTTP 500" in v[4].why
    assert not v[5].solo and "prompt tokens differ from dflash prefill" in v[5].why


def test_response_parts_from_a_stream_and_a_body():
    call = wl.Call("s", wl.CHAT, {"messages": []}, stream=True)
    fp = {"response_tokens": [1, 2], "logits_sha256": "l", "prompt_sha256": "p", "response_tokens_sha256": "r"}
    chunks = [{"choices": [{"delta": {"content": "he"}, "logprobs": {"content": [
        {"id": 1, "logprob": -0.1, "top_logprobs": [{"id": 1, "logprob": -0.1}]}]}}]},
        {"choices": [{"delta": {"content": "llo"}, "logprobs": {"content": [{"id": 2, "logprob": -0.2}]},
                      "finish_reason": "length"}], "dflash": fp, "system_fingerprint": "dflash-x",
         "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}]
    r = wl._from_parts(call, 200, chunks, 1.0, 0.2)
    assert (r.text, r.tokens, r.cached_tokens, r.prompt_tokens, r.finish_reason) == ("hello", (1, 2), 4, 9, "length")
    assert r.logprobs == ((1, -0.1, ((1, -0.1),)), (2, -0.2, ()))
    assert wl._from_parts(call, 200, chunks[:1], 1.0, None).error  # no fingerprints: an error, never a pass


def test_checkpoint_spacing_is_the_lcm_of_the_compress_ratios():
    assert serve_config.checkpoint_every([0, 0, 4, 128, 4, 128]) == 128
    assert serve_config.checkpoint_every([4, 4]) == 4
    assert serve_config.checkpoint_every([6, 4, 0]) == 12
    assert serve_config.checkpoint_every([]) == serve_config.checkpoint_every([0, 0]) == 0


def test_a_refusal_names_the_qualify_command_of_its_own_target():
    """What `dflash serve` suggests when no serve record vouches for a configuration is the command
    whose record would: model or weights, flavor, device, key-changing options, llama-server options."""
    from dflash import serve as serve_lib
    from dflash.core import settings
    from dflash.serving.serve_check import Target

    check = Target("llama-server", "/lib", "/m.gguf", "stock", "k", "s", "ab" * 32, device="vulkan:0",
                   extra=("--top-k", "1"))
    t = serve_lib.ServeTarget(check, settings.resolve({settings.ENV_TILE: "64", settings.ENV_SHORTCUT: "off"}),
                              weights="q8_0")
    cfg = serve_config.ServeConfig(4, 64, 1024, 2)
    assert serve_lib.qualify_command(t, cfg) == (
        "DFLASH_DS4_INDEXER_SHORTCUT=off dflash qualify --serve --parallel 4 --ubatch 64 --weights q8_0 --lib stock "
        "--device vulkan:0 --indexer-tile 64 -- --top-k 1")
    with_model = serve_lib.ServeTarget(check, settings.resolve({}), given_model="/my models/x.gguf")
    assert "--model '/my models/x.gguf'" in serve_lib.qualify_command(with_model, cfg)
