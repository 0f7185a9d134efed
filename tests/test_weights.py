"""``--init-from``, ``--init-map`` and ``python -m jaxdist.export`` on the built-in GPT.

The reference is numpy and the safetensors package itself: a file written with
``safetensors.numpy.save_file`` of seeded arrays, named and shaped as a PyTorch model
would hold them (``(out, in)`` weights, q | k | v fused, an unpadded vocabulary, a
longer position table); the map's transposes and reorders redone with ``np.transpose``
and ``reshape``; the parameters after ``--init-from`` must equal them exactly in every
layout (and the state's optimizer start fresh). Export reads the map backwards: its file
must hold the trained parameters in the file's form, and reading it back must give them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from safetensors import safe_open
from safetensors.numpy import save_file

import jaxdist
from helpers import metrics_of, read_in
from jaxdist.errors import ConfigError
from jaxdist.export import main as export_main
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train
from jaxdist.weights import files

D, LAYERS, HEADS, T, VOCAB, ROWS = 32, 2, 4, 16, 257, 384  # 257 ids padded to 384 rows
E = D // HEADS
MAP = {
    "params": [
        {"from": "embed.weight", "to": "tok/embedding", "pad_rows": "vocab_size"},
        {"from": "positions.weight", "to": "pos/embedding", "first_rows": True},
        {"from": "final_norm.weight", "to": "ln_f/scale"},
        {"from": "final_norm.bias", "to": "ln_f/bias"},
        {"from": "layers.{i}.norm{n:[12]}.weight", "to": "blocks/{i}/ln{n}/scale"},
        {"from": "layers.{i}.norm{n:[12]}.bias", "to": "blocks/{i}/ln{n}/bias"},
        {"from": "layers.{i}.qkv.weight", "to": "blocks/{i}/qkv/kernel",
         "rearrange": "(three h e) d -> d (h three e)", "sizes": {"three": 3, "h": "n_heads"}},
        {"from": "layers.{i}.qkv.bias", "to": "blocks/{i}/qkv/bias",
         "rearrange": "(three h e) -> (h three e)", "sizes": {"three": 3, "h": "n_heads"}},
        {"from": "layers.{i}.{m:proj|fc|out}.weight", "to": "blocks/{i}/{m}/kernel",
         "rearrange": "o i -> i o"},
        {"from": "layers.{i}.{m:proj|fc|out}.bias", "to": "blocks/{i}/{m}/bias"},
    ],
    "ignore": [r"rotary\..*"],
}  # fmt: skip


def torch_style_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.normal(size=shape).astype(np.float32)

    out = {"embed.weight": r(VOCAB, D), "positions.weight": r(2 * T, D),
           "final_norm.weight": r(D), "final_norm.bias": r(D), "rotary.unused": r(3)}  # fmt: skip
    for i in range(LAYERS):
        out |= {f"layers.{i}.norm{n}.{k}": r(D) for n in (1, 2) for k in ("weight", "bias")}
        out |= {f"layers.{i}.qkv.weight": r(3 * D, D), f"layers.{i}.qkv.bias": r(3 * D)}
        for name, (o, i_) in {"proj": (D, D), "fc": (4 * D, D), "out": (D, 4 * D)}.items():
            out |= {f"layers.{i}.{name}.weight": r(o, i_), f"layers.{i}.{name}.bias": r(o)}
    return out


def expected_params(src: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the map must make of ``src``, written with numpy alone."""
    tok = np.zeros((ROWS, D), np.float32)
    tok[:VOCAB] = src["embed.weight"]
    out = {"tok/embedding": tok, "pos/embedding": src["positions.weight"][:T],
           "ln_f/scale": src["final_norm.weight"], "ln_f/bias": src["final_norm.bias"]}  # fmt: skip
    for i in range(LAYERS):
        b = f"blocks/{i}"
        for n in (1, 2):
            out[f"{b}/ln{n}/scale"] = src[f"layers.{i}.norm{n}.weight"]
            out[f"{b}/ln{n}/bias"] = src[f"layers.{i}.norm{n}.bias"]
        # rows q | k | v, each head-major -> columns head by head, each head's q, k, v
        w = src[f"layers.{i}.qkv.weight"].reshape(3, HEADS, E, D)
        out[f"{b}/qkv/kernel"] = w.transpose(3, 1, 0, 2).reshape(D, 3 * D)
        bias = src[f"layers.{i}.qkv.bias"].reshape(3, HEADS, E)
        out[f"{b}/qkv/bias"] = bias.transpose(1, 0, 2).reshape(3 * D)
        for m in ("proj", "fc", "out"):
            out[f"{b}/{m}/kernel"] = src[f"layers.{i}.{m}.weight"].T
            out[f"{b}/{m}/bias"] = src[f"layers.{i}.{m}.bias"]
    return out


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    src = torch_style_tensors()
    save_file(src, str(folder / "model.safetensors"))
    (folder / "map.yaml").write_text(yaml.safe_dump(MAP))
    return folder, src


def settings(*extra: str):
    return config_lib.parse_args([
        "--model", "gpt", "--d-model", str(D), "--n-layers", str(LAYERS), "--n-heads",
        str(HEADS), "--seq-len", str(T), "--data", "grammar", "--global-batch-size", "8",
        "--steps", "3", "--log-every", "1", "--checkpoint-every", "0", *extra,
    ])  # fmt: skip


initial = read_in  # the run a config starts: its state is the file's weights


LAYOUTS = {
    "pmap, 2 copies": ["--strategy", "pmap", "--num-devices", "2"],
    "fsdp=2,model=2": ["--num-devices", "4", "--mesh", "fsdp=2,model=2"],
    "stage=2 (stacked)": ["--num-devices", "2", "--mesh", "stage=2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_from_sets_exactly_the_mapped_arrays_in_every_layout(weights_file, layout,
                                                                  monkeypatch):  # fmt: skip
    folder, src = weights_file
    reads = []  # (tensor, elements read): each process reads only its devices' regions
    real_read = files.Reader.read
    monkeypatch.setattr(files.Reader, "read", lambda self, name, index=(): reads.append(
        (name, (part := real_read(self, name, index)).size)) or part)  # fmt: skip
    run = initial(settings("--init-from", str(folder / "model.safetensors"), "--init-map",
                           str(folder / "map.yaml"), *LAYOUTS[layout]))  # fmt: skip
    params = run.dp.host_params(run.state, per_layer=True)
    want = expected_params(src)
    assert sorted(params) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    one = run.dp.unreplicate(run.state)
    assert int(np.asarray(one.step).reshape(-1)[0]) == 0
    moments = [np.asarray(x) for x in _leaves(one.opt_state) if np.ndim(x) > 1]
    assert moments and all(not m.any() for m in moments)  # AdamW's moments start at zero
    fc = [size for name, size in reads if name == "layers.0.fc.weight"]
    # (128, 32): fsdp x model split it in four, each quarter read once; a layer of a stack
    # is held split over the stage devices (saved_state); pmap's copies: read once, whole
    parts = {"fsdp=2,model=2": 4, "stage=2 (stacked)": 2, "pmap, 2 copies": 1}[layout]
    assert fc == [4 * D * D // parts] * parts


def reads_and_params(rank: int, folder: str) -> tuple[list, dict[str, np.ndarray]]:
    """One of two processes (``jaxdist.spawn``, 2 CPU devices each) loading ``--init-from``
    under fsdp=2,model=2: the regions it read of ``layers.0.fc.weight``, and the params."""
    reads = []  # ((start, stop) per axis, elements)
    real_read = files.Reader.read

    def counting(self, name, index=()):
        part = real_read(self, name, index)
        if name == "layers.0.fc.weight":
            reads.append((tuple((s.start, s.stop) for s in index), part.size))
        return part

    files.Reader.read = counting
    run = initial(settings("--init-from", f"{folder}/model.safetensors", "--init-map",
                           f"{folder}/map.yaml", "--mesh", "fsdp=2,model=2"))  # fmt: skip
    return reads, run.dp.host_params(run.state, per_layer=True)


def test_two_processes_each_read_only_their_own_devices_regions(weights_file):
    folder, src = weights_file
    ranks = jaxdist.spawn(reads_and_params, args=(str(folder),), nprocs=2,
                          cpu_devices_per_proc=2, timeout=120)  # fmt: skip
    quarter = 4 * D * D // 4  # (128, 32) split four ways by fsdp x model
    for reads, _ in ranks:  # each process: its own two devices' quarters, nothing else
        assert [size for _, size in reads] == [quarter, quarter], reads
    regions = [region for reads, _ in ranks for region, _ in reads]
    assert len(set(regions)) == 4, regions  # together: the whole tensor, each part once
    want = expected_params(src)
    for _, params in ranks:
        assert sorted(params) == sorted(want)
        for name, value in want.items():
            np.testing.assert_array_equal(params[name], value, err_msg=name)


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_export_writes_the_trained_params_in_the_files_form_and_a_resume_skips_the_file(
    weights_file, tmp_path
):
    folder, src = weights_file
    path, run_dir, out = tmp_path / "model.safetensors", tmp_path / "run", tmp_path / "export"
    save_file(src, str(path))
    mapping = ["--init-map", str(folder / "map.yaml")]
    common = ["--init-from", str(path), *mapping, "--num-devices", "2", "--run-dir", str(run_dir)]
    run = train(settings(*common), quiet=True)
    trained = run.dp.host_params(run.state, per_layer=True)
    args = [str(run_dir), "--out", str(out), "--map", mapping[1], "--max-shard-size", "40KB"]
    assert export_main(args) == 0
    index = json.loads((out / files.INDEX).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    exported = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(out / shard), "numpy") as f:
            exported |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert "rotary.unused" not in exported  # ignored on the way in: nothing of it to write
    assert exported["embed.weight"].shape == (VOCAB, D)  # the padding rows are not written
    assert exported["positions.weight"].shape == (T, D)  # the model's positions
    # the file's form again, by numpy: expected_params of it must be the trained params
    remade = expected_params(exported)
    for name, value in trained.items():
        np.testing.assert_array_equal(remade[name], value, err_msg=name)
    # the folder of shards, read back through its index, is the run's end
    again = initial(settings("--init-from", str(out), *mapping, "--num-devices", "2"))
    back = again.dp.host_params(again.state, per_layer=True)
    for name, value in trained.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    # a resume continues from the checkpoint: a run that read the file again would fail
    path.unlink()
    resumed = train(settings(*common, "--steps", "5"), quiet=True)
    assert (run.begin.step, resumed.begin.step) == (0, 3)
    assert [m["step"] for m in metrics_of(run_dir) if "loss" in m][-1] == 5


def test_unmatched_names_on_both_sides_are_listed_with_shapes(weights_file, tmp_path):
    folder, src = weights_file
    bad = dict(src)
    bad["layers.9.fc.weight"] = bad.pop("layers.1.fc.weight")  # a layer the model lacks
    bad["final_norm.weight"] = np.ones(D + 1, np.float32)  # the wrong size
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError) as err:
        initial(settings("--init-from", str(tmp_path / "bad.safetensors"), "--init-map",
                         str(folder / "map.yaml"), "--num-devices", "2"))  # fmt: skip
    message = str(err.value)
    assert (
        "1 parameters of the model that no tensor of the file gives: blocks/1/fc/kernel [32, 128]"
        in message
    )  # noqa: E501
    assert "match no parameter (nor 'ignore'): layers.9.fc.weight [128, 32]" in message
    assert (
        "final_norm.weight -> ln_f/scale: the file's [33] makes [33], the model has [32]" in message
    )  # noqa: E501


def test_export_refuses_a_folder_in_use_and_a_non_run_writing_nothing(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("x")
    assert export_main([str(tmp_path), "--out", str(used)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert export_main([str(tmp_path), "--out", str(tmp_path / "new")]) == 2
    assert "no checkpoints folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]


def test_a_missing_file_or_map_is_refused_before_data_or_compilation(tmp_path, monkeypatch):
    from jaxdist.train import build_data

    monkeypatch.setattr(build_data, "build", lambda *a, **k: pytest.fail("data prepared"))
    with pytest.raises(ConfigError, match="no such file or folder"):
        initial(settings("--init-from", str(tmp_path / "absent.safetensors")))
    (tmp_path / "w.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no such file, nor a shipped map .*gpt2"):
        initial(settings("--init-from", str(tmp_path / "w.safetensors"), "--init-map", "gpt3"))
