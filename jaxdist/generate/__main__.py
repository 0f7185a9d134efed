"""``python -m jaxdist.generate SOURCE --prompt TEXT [--prompt TEXT ...]``: text from a
run directory's newest good checkpoint or a Hugging Face folder (``rebuild``).

Greedy by default; ``--temperature`` samples (with ``--top-k``, ``--top-p``, ``--seed``).
Prompts as text (``--prompt``, through the source's tokenizer or ``--tokenizer PATH``)
or as ids (``--prompt-ids 1,2,3``), several batched in one run, each continued as it
would be alone, for ``--max-new-tokens`` tokens or until the tokenizer's end of
document. One device by default, or ``--mesh data=2,model=2`` as the trainer reads it
(``--cpu-devices N`` emulates N CPU devices). One line on stderr says what runs where;
stdout is each prompt with its completion (``--json``: one JSON object per prompt).
Exit 0: generated; 2: bad input, said in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxdist.errors import JaxdistError

__all__ = ["main"]

DEFAULT_NEW = 32  # new tokens per prompt when --max-new-tokens is not given


def _text(value: str):
    return ("text", value)


def _ids(value: str):
    return ("ids", value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxdist.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("source", metavar="SOURCE", type=Path,
                   help="a run directory or a Hugging Face model folder")  # fmt: skip
    # both kinds of prompt go to one list, in the order given
    p.add_argument("--prompt", dest="prompts", action="append", type=_text, default=[],
                   metavar="TEXT", help="a prompt as text (repeat for a batch)")  # fmt: skip
    p.add_argument("--prompt-ids", dest="prompts", action="append", type=_ids,
                   metavar="IDS", help="a prompt as token ids, e.g. 1,2,3")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"default {DEFAULT_NEW}, or fewer where the context ends")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the fewest tokens holding this probability")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the sampling's random seed")
    p.add_argument("--tokenizer", default="", metavar="PATH",
                   help="a tokenizer.json or its folder (default: the source's)")  # fmt: skip
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint of this step")
    p.add_argument("--mesh", default="", help="e.g. data=2,model=2 (default: one device)")
    p.add_argument("--cpu-devices", type=int, default=0, metavar="N",
                   help="emulate N CPU devices (before JAX starts)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except JaxdistError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if not args.prompts:
        raise JaxdistError("no prompt: give --prompt TEXT or --prompt-ids 1,2,3")
    from jaxdist.cluster.process_group import use_cpu_devices

    use_cpu_devices(args.cpu_devices)  # before anything starts JAX's backend
    import jax

    import jaxdist
    from jaxdist.generate import Sampling, generate
    from jaxdist.generate.generator import check
    from jaxdist.generate.rebuild import rebuild
    from jaxdist.parallel.device_mesh import parse_mesh

    mesh, where = None, f"1 {jax.devices()[0].platform} device"
    if args.mesh:  # the trainer's reading: data takes the devices the other axes leave
        mesh = jaxdist.make_mesh(**{"data": -1, **parse_mesh(args.mesh)})
        shown = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "data=1"
        where = f"{mesh.size} {mesh.devices.flat[0].platform} device(s), mesh {shown}"
    rebuilt = rebuild(args.source, args.step, args.tokenizer)
    tokenizer = rebuilt.tokenizer
    prompts = [_encode(kind, value, tokenizer, i) for i, (kind, value) in enumerate(args.prompts)]
    new = args.max_new_tokens
    if new is None:  # the default stops at the context; a number given past it is refused
        room = (rebuilt.context or 0) - max(map(len, prompts))
        new = max(1, min(DEFAULT_NEW, room)) if rebuilt.context else DEFAULT_NEW
    Sampling(args.temperature, args.top_k, args.top_p)  # refused before the line below
    check(rebuilt.model, prompts, new, context=rebuilt.context, mesh=mesh)
    print(f"jaxdist generate: {rebuilt.what}, on {where}", file=sys.stderr, flush=True)
    for note in rebuilt.notes:
        print(f"jaxdist generate: {note}", file=sys.stderr, flush=True)
    out = generate(
        rebuilt.model, prompts, new, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        eos_id=None if tokenizer is None else tokenizer.eos_id, context=rebuilt.context,
        mesh=mesh,
    )  # fmt: skip
    for i, ((kind, value), ids) in enumerate(zip(args.prompts, prompts, strict=True)):
        completion = out.ids[i]
        text = None if tokenizer is None else tokenizer.decode(completion)
        prompt = value if kind == "text" else (tokenizer.decode(ids) if tokenizer else None)
        if args.json:
            row = {"prompt": prompt, "prompt_ids": ids, "ids": completion, "text": text,
                   "stopped": out.stopped[i]}  # fmt: skip
            print(json.dumps(row))
            continue
        if len(prompts) > 1:
            print(f"==> prompt {i + 1} <==")
        print(prompt + text if text is not None else ",".join(map(str, completion)))
    return 0


def _encode(kind: str, value: str, tokenizer, i: int) -> list[int]:
    """Prompt ``i``'s ids: text through ``tokenizer``, or "1,2,3" read as ids."""
    if kind == "ids":
        try:
            ids = [int(t) for t in value.replace(" ", "").split(",") if t]
        except ValueError:
            raise JaxdistError(f"--prompt-ids {value!r}: give ids such as 1,2,3") from None
    elif tokenizer is None:
        raise JaxdistError(
            f"--prompt {value!r}: this model has no tokenizer to read text with (none in the "
            "source, and its vocabulary is not bytes); give --tokenizer PATH or --prompt-ids"
        )
    else:
        ids = tokenizer.encode(value)
    if not ids:
        raise JaxdistError(f"prompt {i + 1} is empty: a prompt needs at least one token")
    return ids


if __name__ == "__main__":
    sys.exit(main())
