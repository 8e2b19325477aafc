"""`dflash --version`: dflash's version, the llama.cpp it builds, and this host's build keys (each key
hashes every input of its build: sources, patch sets, the CPU's flags, the toolchain)."""
from __future__ import annotations

from typing import Any

from dflash.core.errors import DflashError
from dflash.core.paths import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, VERSION
from dflash.native import build

BUILDS = (("exact", "none"), ("stock", "none"), ("exact", "vulkan"), ("stock", "vulkan"))


def facts() -> dict[str, Any]:
    """The version facts as one JSON object (the keys are null where no source checkout is found)."""
    out: dict[str, Any] = {"dflash": VERSION, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                           "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "builds": [], "llama_server": None,
                           "note": None}
    try:
        for flavor, gpu in BUILDS:
            if gpu == "vulkan" and build.vulkan_missing():
                continue  # no Vulkan toolchain: no Vulkan build can exist here
            out["builds"].append({"flavor": flavor, "gpu": gpu, "cpu": "native", "key": build.build_key(flavor, gpu),
                                  "built": build.is_built(flavor, gpu)})
        out["llama_server"] = {"key": build.server_key(), "built": build.server_built()}
    except DflashError as e:
        out["note"] = e.render()
    return out


def text(f: dict[str, Any]) -> str:
    lines = [f"dflash {f['dflash']}",
             f"llama.cpp {f['llama_cpp_commit']} (the source llama-cpp-python {f['llama_cpp_python']} vendors)"]
    if f["note"]:
        return "\n".join([*lines, f"build keys: none ({f['note']})"])
    lines.append("build keys on this host (~/.cache/dflash/llama/<flavor>-<key>):")
    for b in f["builds"]:
        lines.append(f"  {b['flavor']:<6} {b['gpu'] if b['gpu'] != 'none' else 'cpu':<7} {b['key']}  "
                     f"{'built' if b['built'] else 'not built'}")
    s = f["llama_server"]
    lines.append(f"  llama-server   {s['key']}  {'built' if s['built'] else 'not built'}")
    return "\n".join(lines)
