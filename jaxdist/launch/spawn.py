"""``jaxdist.spawn(fn, args, nprocs)``: PyTorch's ``torch.multiprocessing.spawn``.

Each process is a fresh interpreter, never a fork of the caller (a forked JAX runtime
is not safe to use): it imports ``fn`` by module and qualified name, joins the group
``python -m jaxdist.launch`` would form (the same ``jaxdist.launch.group``), calls
``jaxdist.initialize()`` and then ``fn(rank, *args)``. Arguments and return values
travel by pickle through a temporary directory.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path

from jaxdist.launch import group
from jaxdist.launch.rank_output import Output

# Run by each process: the caller's sys.path first, so that fn's module imports there too.
BOOTSTRAP = """import json, os, sys
sys.path[:0] = json.load(open(os.path.join(sys.argv[1], "path.json")))
from jaxdist.launch.spawn import _child
_child(sys.argv[1])
"""


class SpawnError(RuntimeError):
    """A spawned process failed. ``rank``: the first to fail, by time; ``exit_code``: its
    code (128 + S for a death by signal S); ``traceback``: its traceback text ("" when
    it did not raise: killed, or exited on its own)."""

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.rank, self.exit_code, self.traceback = rank, exit_code, ""


def spawn(
    fn,
    args: tuple = (),
    nprocs: int = 1,
    *,
    cpu_devices_per_proc: int = 0,
    gpus_per_proc: int = 0,
    grace: float = 5.0,
    timeout: float | None = None,
) -> list:
    """Runs ``fn(rank, *args)`` in ``nprocs`` new processes joined as one group; returns
    their return values in rank order.

    ``fn`` must be importable: a function defined with ``def`` at the top level of a
    module (or of the script being run). ``cpu_devices_per_proc=K`` emulates K CPU devices
    in each process; ``gpus_per_proc=K`` gives process r the GPUs r*K .. r*K+K-1. When a
    process fails, the others are ended within ``grace`` s and ``SpawnError`` names the
    first that failed, with its traceback. Ctrl-C ends them all; so does ``timeout`` s
    (``SpawnError``). Nothing is left running.

    Example::

        def train(rank, steps):  # in my_module.py
            ...
            return dp.host_params(state)

        params = jaxdist.spawn(my_module.train, args=(100,), nprocs=2)[0]
    """
    target = _locate(fn)
    if nprocs < 1:
        raise ValueError(f"jaxdist.spawn: nprocs must be >= 1, got {nprocs}")
    with tempfile.TemporaryDirectory(prefix="jaxdist-spawn-") as work:
        paths = [os.path.abspath(p) for p in sys.path]  # "" is the caller's directory
        Path(work, "path.json").write_text(json.dumps(paths))
        Path(work, "target.json").write_text(json.dumps(target))
        Path(work, "args.pkl").write_bytes(pickle.dumps(tuple(args)))
        try:
            first = group.run(
                [sys.executable, "-c", BOOTSTRAP, work],
                nprocs,
                Output("spawn"),
                grace=grace,
                timeout=timeout,
                cpu_devices_per_proc=cpu_devices_per_proc,
                gpus_per_proc=gpus_per_proc,
            )
        except TimeoutError:
            name = target["name"]
            raise SpawnError(f"{name}: not finished after {timeout:g}s; all ended") from None
        if first is not None:
            raise _failure(first, Path(work), target["name"])
        return [pickle.loads(Path(work, f"result-{r}.pkl").read_bytes()) for r in range(nprocs)]


def _failure(first: group.Exit, work: Path, name: str) -> SpawnError:
    error = work / f"error-{first.rank}.txt"
    text = error.read_text() if error.exists() else ""
    detail = text.rstrip() or "(no traceback: the process did not raise)"
    failure = SpawnError(f"{name}: {first}\n{detail}", first.rank, first.code)
    failure.traceback = text
    return failure


def _locate(fn) -> dict:
    """How a fresh interpreter finds ``fn``; a ValueError, before anything starts, if
    it cannot."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    name = f"{module}.{qualname}" if module and qualname else repr(fn)
    main = sys.modules.get("__main__")
    source = _main_source(main) if module == "__main__" else {"module": module}
    why = None
    if not callable(fn) or not (module and qualname):
        why = "it has no module-level name"
    elif "<lambda>" in qualname:
        why = "a lambda has no name to import it by"
    elif "<locals>" in qualname:
        why = "it is defined inside a function (a closure)"
    elif source is None:
        why = "it is defined in __main__ of an interactive session (a notebook, the REPL, -c)"
    elif _lookup(sys.modules.get(module), qualname) is not fn:
        why = f"{name} names another object (fn was redefined or wrapped)"
    if why:
        raise ValueError(
            f"jaxdist.spawn cannot run {name}: {why}. Each process is a fresh Python "
            "interpreter that imports fn by module and name: define it with def at the top "
            "level of a .py file and import it from there."
        )
    return {"name": name, "qualname": qualname, **source}


def _main_source(main) -> dict | None:
    """``python -m pkg.mod``: import pkg.mod; ``python script.py``: load the file (as
    multiprocessing does, under another name, so its ``__main__`` block does not run)."""
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return {"module": spec.name, "main": True}
    path = getattr(main, "__file__", None)
    if path and os.path.isfile(path):
        return {"file": os.path.abspath(path), "main": True}
    return None


def _lookup(module, qualname: str):
    try:
        return functools.reduce(getattr, qualname.split("."), module)
    except AttributeError:
        return None


def _import(target: dict):
    if "file" in target:
        spec = importlib.util.spec_from_file_location("__mp_main__", target["file"])
        module = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target["module"])
    if target.get("main"):  # pickles that name __main__'s objects resolve here
        sys.modules["__main__"] = module
    return _lookup(module, target["qualname"])


def _child(work: str) -> None:
    """One spawned process. Any failure writes its traceback and exits 1 at once: a
    normal exit would wait in JAX's shutdown barrier for the others."""
    rank = int(os.environ["JAXDIST_PROCESS_ID"])
    try:
        fn = _import(json.loads(Path(work, "target.json").read_text()))
        args = pickle.loads(Path(work, "args.pkl").read_bytes())  # after fn's module
        from jaxdist.cluster.process_group import initialize

        initialize()
        result = fn(rank, *args)
        Path(work, f"result-{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:  # SystemExit and KeyboardInterrupt too: reported, not hidden
        text = traceback.format_exc()
        with contextlib.suppress(OSError):
            Path(work, f"error-{rank}.txt").write_text(text)
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
