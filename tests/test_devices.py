"""--device parsing (cpu, hip:N, cuda:N, two-GPU layer splits) and the missing-GPU exit code."""
import pytest

from dflash.core.errors import UsageError
from dflash.native import devices
from dflash.proof import records

from .conftest import run_dflash


@pytest.mark.parametrize("spec,kind,ids", [("cpu", "cpu", []), ("hip:0", "hip", [0]), ("HIP:1,hip:0", "hip", [1, 0]),
                                           ("cuda:0", "cuda", [0]), ("cuda:0,cuda:1", "cuda", [0, 1]),
                                           ("vulkan:0", "vulkan", [0]), ("Vulkan:1,vulkan:0", "vulkan", [1, 0])])
def test_device_specs(spec, kind, ids):
    assert devices.device_kind(spec) == kind and devices.parse_device(spec) == ids
    assert records.device_name(spec) == (",".join(f"{kind}:{i}" for i in ids) if ids else "cpu")


def test_a_client_of_vulkan_rpc_servers_loads_the_vulkan_build():
    """Every RPC server serves a Vulkan device: the client runs that build too (one build on both
    ends); a CPU server among them, a server that does not say, or a local GPU keep their kind."""
    assert devices.device_kind("rpc:0", ["vulkan:0"]) == "vulkan"
    assert devices.device_kind("cpu,rpc:0,rpc:1", ["vulkan:0", "vulkan:1"]) == "vulkan"
    assert devices.device_kind("rpc:0,rpc:1", ["vulkan:0", "cpu"]) == "cpu"
    assert devices.device_kind("rpc:0", [None]) == "cpu"
    assert devices.device_kind("rpc:0", []) == "cpu"
    assert devices.device_kind("hip:0,rpc:0", ["vulkan:0"]) == "hip"


@pytest.mark.parametrize("spec", ["gpu:0", "hip:0,cuda:1", "cuda:x", "cuda:0,cuda:0", "hip:", "rpc:x",
                                  "cuda", "hip", "vulkan", "vulkan:0,hip:0", "vulkan:-1"])
def test_bad_device_specs_are_usage_errors(spec):
    with pytest.raises(UsageError):
        devices.parse_device(spec)


VULKANINFO = """==========
VULKANINFO
==========
Devices:
========
GPU0:
	apiVersion         = 1.3.230
	deviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
	deviceName         = AMD Radeon AI PRO R9700 (RADV GFX1201)
	driverName         = radv
	driverInfo         = Mesa 25.0.7
GPU1:
	deviceType         = PHYSICAL_DEVICE_TYPE_CPU
	deviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
	driverName         = llvmpipe
	driverInfo         = Mesa 22.3.6 (LLVM 15.0.6)
"""


def test_vulkaninfo_devices_in_the_loaders_order_keyed_by_driver():
    found = devices.parse_vulkaninfo(VULKANINFO)
    assert found is not None
    radv, lvp = found[0]
    assert (radv.id, radv.name, radv.arch) == ("vulkan:0", "AMD Radeon AI PRO R9700 (RADV GFX1201)", "radv Mesa 25.0.7")
    assert (lvp.id, lvp.arch) == ("vulkan:1", "llvmpipe Mesa 22.3.6 (LLVM 15.0.6)")
    assert devices.parse_vulkaninfo("Devices:\n========\n") is None


def test_vulkan_ids_map_to_the_librarys_visible_devices(monkeypatch):
    """GGML_VK_VISIBLE_DEVICES lists the named devices in order: vulkan:3 alone is the library's
    device 0; vulkan:2,vulkan:0 are its devices 1 and 0."""
    from dflash.native import llama
    from dflash.run import engine
    monkeypatch.setattr(llama, "library_dir", lambda: None)
    monkeypatch.delenv("GGML_VK_VISIBLE_DEVICES", raising=False)
    assert engine.vulkan_visible([3]) == {3: 0}
    assert engine.vulkan_visible([2, 0]) == {0: 0, 2: 1}
    import os
    assert os.environ["GGML_VK_VISIBLE_DEVICES"] == "0,2"
    monkeypatch.setattr(llama, "library_dir", lambda: "/loaded")
    with pytest.raises(Exception, match="needs a process of its own"):
        engine.vulkan_visible([1])


def test_a_missing_cuda_device_exits_3():
    found, _ = devices.cuda_devices()
    if found:
        pytest.skip(f"this machine has a CUDA device ({found[0].name}): the missing-device path cannot run")
    r = run_dflash("prefill", "--device", "cuda:0", "--threads", "1")
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


def test_gpu_qualification_records_are_keyed_by_the_routing_flags(tiny_models):
    """On a GPU, DFLASH_NARROW_MMVQ and LUCE_MMVQ_MAX_NCOLS decide which kernels run: a record made
    with the hooks off must not vouch for a run with them on. On the CPU neither changes anything."""
    from dflash.core import settings
    model = tiny_models["f32"]
    on = settings.resolve({}, bands=True)
    off = settings.resolve({"DFLASH_NARROW_MMVQ": "0"}, bands=True)
    wider = settings.resolve({"LUCE_MMVQ_MAX_NCOLS": "8"}, bands=True)
    keys = {name: records.identity(s, model, "hip:0").key for name, s in
            (("on", on), ("off", off), ("wider", wider))}
    assert len(set(keys.values())) == 3
    assert records.identity(on, model, "cpu").key == records.identity(off, model, "cpu").key
    assert records.identity(on, model, "cuda:0").key != records.identity(on, model, "hip:0").key
