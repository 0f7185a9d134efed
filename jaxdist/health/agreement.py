"""Agreement before the first step: every process must run the same thing.

Processes given different flags, or built from different installs, otherwise train side
by side on a wrong loss (a different ``--global-batch-size`` on one of them), or fail
deep inside a collective (a different model width: a gloo size error). So before the
first step the processes compare, through the coordination service, a record of named
fields, in this order: the resolved config; the versions of jaxdist, jax, jaxlib, flax,
optax, orbax and numpy; the process and device counts; the mesh and the state's layout;
and the lowered training step (a hash of its text, which carries the input shapes and
dtypes). The first field in which any process differs from process 0 stops every
process, naming the field, the processes and both values (for the program: both
hashes and the first differing line; both texts are saved in the run directory).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import platform
import zlib
from pathlib import Path

import jax

from jaxdist.cluster import store

PREFIX = "jaxdist/agree/"
# Per process by nature: not compared.
PER_PROCESS = ("dist.process_id", "dist.local_device_ids")
PACKAGES = ("jaxdist", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
CHUNK = 512 * 1024  # the store's values stay far below gRPC's message limit


class MismatchError(RuntimeError):
    """The processes differ in what they would run (exit code 78)."""


def setup_fields(config: dict[str, dict], info) -> dict[str, str]:
    """What must agree before anything is loaded: ``config`` (``{section: {key:
    value}}``, e.g. the trainer's resolved config), versions, counts."""
    fields = {}
    for section, values in config.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in PER_PROCESS:
                fields[f"config {name}"] = json.dumps(value)
    for package in PACKAGES:
        try:
            fields[f"version of {package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            fields[f"version of {package}"] = "(not installed)"
    fields["version of python"] = platform.python_version()
    fields["process count"] = str(info.process_count)
    fields["device count"] = str(info.device_count)
    fields["local device count"] = str(info.local_device_count)
    fields["platform"] = f"{info.platform} {jax.local_devices()[0].device_kind}"
    return fields


def program_fields(mesh, state_sharding, lowered_text: str) -> dict[str, str]:
    """What must agree once the step is built: mesh, layout, program."""
    specs = [
        f"{jax.tree_util.keystr(path)}: {getattr(s, 'spec', s)}"
        for path, s in jax.tree_util.tree_leaves_with_path(state_sharding)
    ]
    return {
        "mesh": ",".join(f"{axis}={size}" for axis, size in mesh.shape.items()),
        "layout": _digest("\n".join(specs)),
        "program": _digest(lowered_text),
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree(
    name: str,
    fields: dict[str, str],
    *,
    timeout_s: float,
    program_text: str = "",
    save_dir: Path | None = None,
) -> None:
    """Raises ``MismatchError`` on every process if any process's ``fields`` differ from
    process 0's; returns once every process has compared. ``name``: this round's own
    (a later round, after a recompilation, uses another)."""
    count, index = jax.process_count(), jax.process_index()
    if count == 1:
        return
    store.put(f"{PREFIX}{name}/{index}", json.dumps(fields))
    records = {
        i: json.loads(store.wait_get(f"{PREFIX}{name}/{i}", timeout_s)) for i in range(count)
    }
    found = _first_difference(records)
    if found and found[0] == "program":
        field, _, other = found
        message = _explain_program(name, records, other, program_text, timeout_s, save_dir)
        found = (field, message, other)
    store.barrier(f"{PREFIX}{name}/compared", timeout_s)
    if found:
        err = MismatchError(found[1])
        err.process = found[2]  # the first process that differs in that field
        raise err


def _first_difference(records: dict[int, dict]) -> tuple[str, str, int] | None:
    """(field, message, first process differing there) for the first field in which a
    process differs from process 0, or None."""
    reference = records[0]
    for field in reference | records[max(records)]:
        differ = [i for i in sorted(records) if records[i].get(field) != reference.get(field)]
        if differ:
            values = ", ".join(
                f"{records[i].get(field, '(missing)')} on process {i}" for i in differ[:3]
            )
            more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
            return (
                field,
                (
                    f"the processes differ in {field}: {reference.get(field, '(missing)')} on "
                    f"process 0, {values}{more}; every process must run the same configuration, "
                    "versions and program"
                ),
                differ[0],
            )
    return None


def _explain_program(name, records, other, text, timeout_s, save_dir) -> str:
    """Both hashes and the first differing line of process 0's lowered step and of the
    first process whose step differs (``other``); both texts saved under ``save_dir``."""
    index = jax.process_index()
    if index in (0, other):
        _publish_text(f"{PREFIX}{name}/text/{index}", text)
    texts = {i: _read_text(f"{PREFIX}{name}/text/{i}", timeout_s) for i in (0, other)}
    first, second = texts[0].splitlines(), texts[other].splitlines()
    line = next(
        (n for n, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )
    shown = [t[line].strip()[:160] if line < len(t) else "(end)" for t in (first, second)]
    saved = ""
    if save_dir is not None and index == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        for i in (0, other):
            (save_dir / f"step-program.process{i}.txt").write_text(texts[i])
        saved = f"; both programs saved in {save_dir}"
    return (
        f"the processes compiled different training steps: hash {records[0]['program']} on "
        f"process 0, {records[other]['program']} on process {other}; first difference at "
        f"line {line + 1}: process 0 has `{shown[0]}`, process {other} has `{shown[1]}`"
        f"{saved}"
    )


def _publish_text(key: str, text: str) -> None:
    packed = base64.b64encode(zlib.compress(text.encode(), 6)).decode()
    chunks = [packed[i : i + CHUNK] for i in range(0, len(packed), CHUNK)] or [""]
    for n, chunk in enumerate(chunks):
        store.put(f"{key}/{n}", chunk)
    store.put(f"{key}/count", str(len(chunks)))


def _read_text(key: str, timeout_s: float) -> str:
    count = int(store.wait_get(f"{key}/count", timeout_s))
    packed = "".join(store.wait_get(f"{key}/{n}", timeout_s) for n in range(count))
    return zlib.decompress(base64.b64decode(packed)).decode()
