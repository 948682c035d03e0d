"""What this machine computes with: the report ``specmesh env`` prints.

The CPU (model name, the feature flags the kernels and dtypes depend on, cores), torch (version,
threads, oneDNN), the dtype ``--dtype auto`` resolves to here and why, and every CPU backend
choice (engine/backend.py) on or off with its reason, for the machine and for that dtype.
"""

from __future__ import annotations

from specmesh.engine.backend import BackendOverrides, CpuBackend, cpu_backend
from specmesh.engine.devices import BF16_CPU_FLAGS, resolve_device, resolve_dtype

#: CPU flags worth showing: what the compiled kernels are built for (AVX2, FMA, AVX-512) and
#: what native bf16 / int8 matmul needs (engine/devices.py BF16_CPU_FLAGS).
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
               "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def auto_dtype(device: str = "auto", backend: CpuBackend | None = None) -> tuple[str, str]:
    """(the dtype ``--dtype auto`` resolves to for ``device`` here, why). The dtype comes from
    the one resolution the commands use (:func:`engine.devices.resolve_dtype`); the reason
    names the facts it rests on (a GPU, the CPU's bf16 flags).

    Raises:
        ValueError: an unknown device name.
    """
    dtype = resolve_dtype("auto", device)
    if resolve_device(device).type == "cuda":
        return dtype, f"{dtype} on a CUDA GPU"
    flags = (backend or cpu_backend()).features.flags
    have = [f for f in BF16_CPU_FLAGS if f in flags]
    if have:
        return dtype, f"the CPU has native bf16 matmul ({', '.join(have)})"
    return dtype, (f"the CPU has no native bf16 matmul (none of {', '.join(BF16_CPU_FLAGS)}): "
                   f"bf16 would be emulated, slower than float32")


def environment_report(device: str = "auto", dtype: str = "auto",
                       overrides: BackendOverrides | None = None,
                       auto: tuple[str, str] | None = None) -> dict:
    """The report as a JSON-ready dict: ``cpu``, ``torch``, ``dtype_auto`` (``dtype``,
    ``why``, ``device``), and ``backends`` (``dtype`` the per-dtype column is for: ``dtype``,
    or what auto picks; ``overrides``; ``choices``: per choice ``on``, ``why``, ``dtypes``,
    ``on_for_dtype``, ``why_for_dtype``). ``auto``: (dtype, why) of ``--dtype auto`` as the
    caller decided it (the cluster's decision, cluster/auto_resolve.py); None: this module's
    rule (:func:`auto_dtype`).

    Raises:
        ValueError: an unknown device name.
    """
    import torch  # torch only for the report: importing this module stays torch-free

    backend = cpu_backend(overrides)
    f = backend.features
    auto, why = auto if auto is not None else auto_dtype(device, backend)
    shown = auto if dtype == "auto" else dtype
    for_dtype = backend.for_dtype(shown)
    choices = {}
    for name, choice in backend.choices().items():
        chosen = getattr(for_dtype, name)
        choices[name] = {**choice.as_dict(), "on_for_dtype": chosen.on,
                         "why_for_dtype": chosen.why}
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return {
        "cpu": {"model_name": f.model_name, "machine": f.machine, "num_cores": f.num_cores,
                "flags": {flag: flag in f.flags for flag in SHOWN_FLAGS},
                "compiler": f.compiler},
        "torch": {"version": torch.__version__, "num_threads": torch.get_num_threads(),
                  "num_interop_threads": torch.get_num_interop_threads(),
                  "onednn": f.onednn, "cpu_capability": capability,
                  "cuda": torch.cuda.is_available()},
        "dtype_auto": {"dtype": auto, "why": why, "device": device},
        "backends": {"dtype": shown, "overrides": str(backend.overrides) or "none",
                     "choices": choices},
    }


def render_report(report: dict) -> str:
    """The report as text, one fact a line."""
    cpu, tch, auto, back = (report[k] for k in ("cpu", "torch", "dtype_auto", "backends"))
    have = [f for f, on in cpu["flags"].items() if on]
    lack = [f for f, on in cpu["flags"].items() if not on]
    lines = [
        f"cpu         {cpu['model_name']} ({cpu['machine']}), {cpu['num_cores']} cores",
        f"cpu flags   {' '.join(have) or '-'}" + (f"  (not: {' '.join(lack)})" if lack else ""),
        f"compiler    {cpu['compiler'] or 'none (no compiled CPU kernels)'}",
        f"torch       {tch['version']}, {tch['num_threads']} threads "
        f"({tch['num_interop_threads']} inter-op), oneDNN {'yes' if tch['onednn'] else 'no'}"
        + (f", ATen CPU capability {tch['cpu_capability']}" if tch["cpu_capability"] else "")
        + (", CUDA" if tch["cuda"] else ""),
        f"dtype auto  {auto['dtype']} (device {auto['device']}): {auto['why']}",
        f"backends    for a {back['dtype']} model; overrides: {back['overrides']}",
    ]
    width = max(len(n) for n in back["choices"])
    for name, c in back["choices"].items():
        state = "on " if c["on_for_dtype"] else "off"
        why = c["why_for_dtype"]
        if c["on"] and not c["on_for_dtype"]:
            why += f" (on for {', '.join(c['dtypes'])}: {c['why']})"
        lines.append(f"  {name:<{width}}  {state}  {why}")
    return "\n".join(lines)


__all__ = ["SHOWN_FLAGS", "auto_dtype", "environment_report", "render_report"]
