"""What each of the matrix's features runs and compares (experiments/matrix.py runs the
cells): ``FEATURES`` maps a feature to its check, ``check(m, layout, name) -> (status,
detail)``, which trains through ``m.run`` and ``m.ref`` (a ``matrix.Matrix``)."""

from __future__ import annotations

import shutil

import numpy as np

from matrix_rows import elastic_target, model_flags, slug

SGD = ["--optimizer", "sgd", "--lr", "0.3", "--clip-norm", "0", "--momentum", "0"]
RTOL, LOOSE = 1e-4, 3e-2
NAN_STEP = 3  # the ``nan`` fault's step under --nan-policy skip


def close(got: list, want: list, rtol: float) -> float:
    """The largest relative difference of two loss lists (None: a skipped step, which
    must be skipped in both); inf when they differ in length or skips."""
    if len(got) != len(want) or [g is None for g in got] != [w is None for w in want]:
        return float("inf")
    diffs = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True) if w is not None]
    return max(diffs, default=0.0)


def params_close(got: dict, want: dict) -> float:
    if sorted(got) != sorted(want):
        return float("inf")
    return max(
        float(np.linalg.norm(got[k] - want[k]) / max(np.linalg.norm(want[k]), 1e-30)) for k in want
    )


def verdict(result, error: float, rtol: float, what: str) -> tuple[str, str]:
    if result.code != 0:
        return "FAILED", f"exit {result.code}: {result.tail.strip().splitlines()[-1:]}"
    if not error <= rtol:
        return "FAILED", f"{what}: relative difference {error:.2e} > {rtol:g}"
    return "ok", f"{what} within {error:.1e}"


def compared(flags: list[str], rtol=RTOL, env=None, key="loss", what="losses", optim=SGD):
    """A feature whose run equals 1 device's with the same flags (losses and saved params)."""

    def check(m, layout: str, name: str):
        flags_ = [*optim, *flags]
        got, want = m.run(name, layout, flags_, env), m.ref(tuple(flags_), env, layout)
        error = close(got.losses(key), want.losses(key), rtol)
        if got.code == 0 and key == "loss":
            error = max(error, params_close(got.params, want.params) if rtol == RTOL else 0)
        return verdict(got, error, rtol, what + (" and params" if rtol == RTOL else ""))

    return check


def resumed(m, layout: str, name: str, elastic: bool = False):
    """``--checkpoint-every 3``, stopped after step 3's checkpoint, then continued."""
    flags = [*SGD, "--checkpoint-every", "3"]
    full = m.run(name, layout, flags)
    target = elastic_target(layout) if elastic else layout
    return continued(m, name, full, target, flags, {}, exact=target == layout, model=layout)


def continued(m, name: str, full, target: str, flags, env, exact: bool, model=None):
    """``full``'s run directory as a run stopped after step 3 leaves it (its later
    checkpoint removed), continued on ``target``: steps 4-6 equal ``full``'s bit for bit
    (``exact``: on its own layout), or within RTOL. ``model``: the layout row whose
    model ran (default ``target``'s)."""
    if full.code != 0:
        return verdict(full, 0.0, RTOL, "")
    again = m.work / slug(name, "from3", target, str(len(list(m.work.iterdir()))))
    shutil.copytree(m.work / name, again)
    shutil.rmtree(again / "checkpoints" / "6")
    (again / "metrics.jsonl").write_text("")  # what the resumed run logs, alone
    got = m.run(again.name, target, flags, env, run_dir=again, model=model_flags(model or target))
    want = [r["loss"] for r in full.records if r["step"] > 3]
    if not exact:
        return verdict(got, close(got.losses(), want, RTOL), RTOL, f"steps 4-6 on {target}")
    if got.code == 0 and got.losses() == want:
        return "ok", "steps 4-6 bit for bit"
    return verdict(got, close(got.losses(), want, 0), 0, "steps 4-6 against the uninterrupted")


def dropout(m, layout: str, name: str):
    """``--dropout 0.1``: equal to 1 device's where one key serves the global batch; where
    the layout draws one key per replica (``jaxdist.parallel.strategies.wants_per_replica``)
    or per pipeline microbatch, its masks differ: within LOOSE, unlike the run without."""
    flags = [*SGD, "--dropout", "0.1"]
    got, want = m.run(name, layout, flags), m.ref(tuple(flags), layout=layout)
    if got.code != 0:
        return verdict(got, 0.0, RTOL, "")
    error = close(got.losses(), want.losses(), RTOL)
    if error <= RTOL:
        return "ok", f"losses and masks as 1 device's (one key), within {error:.1e}"
    plain = close(got.losses()[1:], m.ref(tuple(SGD), layout=layout).losses()[1:], 0)
    if plain == 0:
        return "FAILED", "dropout did nothing"
    status, detail = verdict(got, close(got.losses(), want.losses(), LOOSE), LOOSE, "losses")
    return status, detail + " (masks per replica or per pipeline microbatch: the key contract)"


FEATURES = {
    "defaults": compared([], rtol=1e-3, what="default AdamW losses", optim=[]),
    "resume": resumed,
    "elastic resume": lambda m, layout, name: resumed(m, layout, name, elastic=True),
    "eval": compared(["--eval-every", "3"], key="eval_loss", what="eval losses"),
    "save-params": compared([]),
    "replica check": compared(["--check-replicas-every", "2"]),
    "grad-accum 2": compared(["--grad-accum", "2"]),
    "bfloat16": compared(["--dtype", "bfloat16"], rtol=LOOSE, what="bf16 losses"),
    "remat block": compared(["--remat", "block"]),
    "dropout": dropout,
    "nan skip": compared(
        ["--nan-policy", "skip"], env={"JAXDIST_FAULT": f"nan@0:{NAN_STEP}"}, what="skipped"
    ),
    # the memory options (AdamW: SGD without momentum has no state to split or offload)
    "shard-optimizer": compared(["--shard-optimizer"], rtol=1e-3, what="AdamW losses", optim=[]),
    "offload optimizer": compared(
        ["--offload", "optimizer"], rtol=1e-3, what="AdamW losses", optim=[]
    ),
    "1f1b": compared(["--pipeline-schedule", "1f1b"]),
    # 4 layers: 2 stages x 2 virtual stages of one layer each
    "interleaved": compared(["--pipeline-schedule", "interleaved", "--n-layers", "4"]),
}
