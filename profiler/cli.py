"""``pipedream-profile``: profile a model from a factory function and write the profile.

Example (from the repository root)::

    pipedream-profile pipedream_ft_examples.models:digits_cnn --input-shape 1,8,8 --batch-size 32 -o digits.json

The model is ``MODULE:FACTORY`` (imported with the current directory on the path) or ``path/to/file.py:FACTORY``
(from any directory; the file's directory goes on the path, so it may import its neighbours); ``--model``
names it as well. A model with several inputs gets one ``--input NAME:SHAPE[:KIND]`` per input, in the order
of its forward's arguments (SHAPE of one sample; KIND a floating dtype such as ``float32`` (random normal),
``int:VOCAB`` (random token ids in ``[0, VOCAB)``) or ``ones`` (an all-ones int64 mask: no padding)), e.g. a
Hugging Face model wrapped by :func:`profiler.hf.for_pipeline` with its attention mask::

    pipedream-profile mymodels.py:llama --input input_ids:128:int:32000 --input attention_mask:128:ones \
        --batch-size 8 -o llama.json

A factory may build its model under ``torch.device("meta")`` (a model too large for the machine): it is then
profiled one layer at a time, each layer materialised alone (:func:`profiler.measure.profile_model`). A raw
Hugging Face ``*ForCausalLM`` is refused with the advice to return ``profiler.hf.for_pipeline(model)``. When the
timings' repeats disagree too much to trust (a busy machine), one warning line on stderr names the worst layers
(:mod:`profiler.noise`).

``OUT`` ending in ``.json`` gets the JSON format, anything else PipeDream's ``graph.txt``. Errors are one line
on stderr starting with ``pipedream-profile: error:`` and exit status 2; the output is then left untouched.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

from .cliutil import CliError, OneLineParser, check_writable, run_cli, write_atomic

PROG = "pipedream-profile"


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Profile a PyTorch model layer by layer for PipeDream partitioning.")
    p.add_argument("target", nargs="?", metavar="MODULE:FACTORY",
                   help="factory returning the model, e.g. pipedream_ft_examples.models:digits_cnn or path/to/file.py:factory")
    p.add_argument("--model", metavar="MODULE:FACTORY", help="the model, as the positional argument names it")
    p.add_argument("--input-shape", metavar="C,H,W", help="shape of one sample, comma separated (one input)")
    p.add_argument("--input", action="append", default=[], metavar="NAME:SHAPE[:KIND]",
                   help="one model input (repeat, in the forward's order): KIND float32..., int:VOCAB or ones")
    p.add_argument("--batch-size", required=True, type=int, metavar="N", help="minibatch size")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", help="floating dtype of model and input (default float32)")
    p.add_argument("--int-input", type=int, metavar="VOCAB", help="feed integer token ids in [0, VOCAB) instead")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per layer (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer; the median is kept (default 5)")
    p.add_argument("--seed", type=int, default=0,
                   help="torch.manual_seed before building the model; a model built on meta has each layer "
                        "initialised from (seed, layer name) (default 0)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output file (.json, else graph.txt)")
    return p


def _parse_shape(text: str, option: str = "--input-shape") -> tuple[int, ...]:
    parts = [s.strip() for s in text.split(",")]
    try:
        shape = tuple(int(s) for s in parts)
    except ValueError:
        raise CliError(f"bad {option} {text!r}: expected positive integers separated by commas, e.g. 1,8,8") from None
    if not shape or any(d <= 0 for d in shape):
        raise CliError(f"bad {option} {text!r}: dimensions must be positive")
    return shape


def _parse_input(text: str) -> tuple[str, tuple[int, ...], str | None]:
    """``NAME:SHAPE[:KIND]`` -> (name, shape, kind or None)."""
    name, sep, rest = text.partition(":")
    shape_text, _, kind = rest.partition(":")
    if not sep or not name.isidentifier() or not shape_text:
        raise CliError(f"bad --input {text!r}: expected NAME:SHAPE[:KIND], e.g. input_ids:128:int:32000")
    shape = _parse_shape(shape_text, f"--input {name}: shape")
    if kind and kind != "ones" and not kind.startswith("int:"):
        return name, shape, kind
    if kind.startswith("int:"):
        try:
            vocab = int(kind[4:])
        except ValueError:
            vocab = 0
        if vocab <= 0:
            raise CliError(f"bad --input {text!r}: int:VOCAB needs a positive vocabulary size")
    return name, shape, kind or None


def _load_file(path: str) -> Any:
    import importlib.util

    file = Path(path).resolve()
    if not file.is_file():
        raise CliError(f"cannot import {path!r}: no such file")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(file.stem, module)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise CliError(f"cannot import {path!r}: {type(exc).__name__}: {exc}") from None
    return module


def _load_factory(target: str) -> tuple[str, Any]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"bad model {target!r}: expected MODULE:FACTORY or path/to/file.py:FACTORY, e.g. "
                       "pipedream_ft_examples.models:digits_cnn")
    if module_name.endswith(".py"):
        module = _load_file(module_name)
    else:
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise CliError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    factory: Any = module
    try:
        for part in attr.split("."):
            factory = getattr(factory, part)
    except AttributeError:
        raise CliError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise CliError(f"{target} is not callable")
    return target, factory


def _write(profile: Any, path: Path) -> None:
    from .graphtxt import dumps_graph_txt

    text = json.dumps(profile.to_json(), indent=1) + "\n" if path.suffix == ".json" else dumps_graph_txt(profile)
    write_atomic(path, text)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _spread(layer: Any) -> str:
    """The layer's spread over its repeats (the larger of forward and backward), or where its times came from."""
    if layer.reused_from is not None:
        return "= " + (layer.reused_from if len(layer.reused_from) <= 16 else layer.reused_from[:13] + "...")
    if layer.forward_spread is None:
        return "-"
    return f"{max(layer.forward_spread, layer.backward_spread or 0.0):.2f}"


def _table(profile: Any) -> str:
    rows = [("layer", "fwd ms", "bwd ms", "spread", "activation", "params")]
    for l in profile.layers:
        name = l.name if len(l.name) <= 24 else l.name[:21] + "..."
        rows.append((name, f"{l.forward_ms:.3f}", f"{l.backward_ms:.3f}", _spread(l), _size(l.activation_bytes),
                     _size(l.parameter_bytes)))
    fwd = sum(l.forward_ms for l in profile.layers)
    bwd = sum(l.backward_ms for l in profile.layers)
    act = sum(l.activation_bytes for l in profile.layers)
    par = sum(l.parameter_bytes for l in profile.layers)
    median = profile.meta.get("timing_spread", {}).get("median_spread")
    rows.append((f"total ({len(profile.layers)} layers)", f"{fwd:.3f}", f"{bwd:.3f}",
                 "-" if median is None else f"{median:.2f}", _size(act), _size(par)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]

    def fmt(r: tuple[str, ...]) -> str:
        return "  ".join([r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(r))])

    lines = [fmt(rows[0]), "-" * len(fmt(rows[0]))] + [fmt(r) for r in rows[1:-1]]
    lines += ["-" * len(fmt(rows[0])), fmt(rows[-1])]
    lines.append("spread: (p75-p25)/median of a layer's timed repeats (total: the median over the layers that "
                 "matter); '= L': times reused from the identical layer L")
    return "\n".join(lines)


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if (args.target is None) == (args.model is None):
        raise CliError("name the model once: MODULE:FACTORY (or path/to/file.py:FACTORY) or --model")
    target = args.target or args.model
    if (args.input_shape is None) == (not args.input):
        raise CliError("give the input as --input-shape (one input) or as one --input NAME:SHAPE[:KIND] per input")
    specs = [_parse_input(t) for t in args.input] if args.input else [("input", _parse_shape(args.input_shape), None)]
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise CliError(f"--input names must differ, got {names}")
    if args.batch_size <= 0:
        raise CliError(f"--batch-size must be positive, got {args.batch_size}")
    if args.warmup < 0 or args.repeats < 1:
        raise CliError("need --warmup >= 0 and --repeats >= 1")
    if args.int_input is not None and args.int_input <= 0:
        raise CliError(f"--int-input must be a positive vocabulary size, got {args.int_input}")
    output = Path(args.output)
    check_writable(output)

    import torch
    from torch import nn

    from .measure import profile_model, resolve_device

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CliError(f"unknown floating dtype {args.dtype!r} (e.g. float32, float64, bfloat16, float16)")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise CliError(str(exc)) from None

    name, factory = _load_factory(target)
    torch.manual_seed(args.seed)
    try:
        model = factory()
    except Exception as exc:
        raise CliError(f"{name}() raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise CliError(f"{name}() returned {type(model).__name__}, not a torch.nn.Module")
    raw = _raw_hf(model, name)
    if raw:
        raise CliError(raw)
    model = model.to(dtype=dtype)
    example = tuple(_example(torch, args, shape, kind, dtype, n) for n, shape, kind in specs)
    if args.input:
        from .layers import layer_graph

        try:
            expected = layer_graph(model).input_names
        except Exception as exc:
            raise CliError(f"profiling {name} failed: {type(exc).__name__}: {exc}") from None
        if expected != names:
            raise CliError(f"{name}() takes inputs {expected}, but --input gives {names} (one per input, in order)")

    try:
        profile = profile_model(
            model,
            example,
            device=device,
            warmup=args.warmup,
            repeats=args.repeats,
            progress=True,
            meta={"model": name},
            seed=args.seed,
            warn=False,
        )
        if not profile.keep_together:  # the model's pipeline_keep_together groups
            from .together import with_keep_together

            profile = with_keep_together(profile, model)
    except Exception as exc:
        raise CliError(f"profiling {name} failed: {type(exc).__name__}: {exc}") from None
    _write(profile, output)
    from .noise import noise_warning

    noisy = noise_warning(profile)
    if noisy:
        print(f"{PROG}: {noisy}", file=sys.stderr)
    print(_table(profile))
    for line in _notes(profile, output):
        print(line)
    print(f"wrote {output} ({len(profile)} layers, structure hash {profile.structure_hash()[:12]})")
    return 0


def _raw_hf(model: Any, name: str) -> str | None:
    """The one-line advice for a transformers model not wrapped by :func:`profiler.hf.for_pipeline`, else None."""
    if not any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__):
        return None
    return (f"{name}() returned a raw Hugging Face {type(model).__name__}, which torch.fx cannot split into "
            "layers: return profiler.hf.for_pipeline(model) from the factory instead (from profiler.hf import "
            "for_pipeline)")


def _example(torch: Any, args: argparse.Namespace, shape: tuple[int, ...], kind: str | None, dtype: Any,
             name: str) -> Any:
    """A random minibatch of one input: ``kind`` (``--input``), else ``--int-input`` / ``--dtype``."""
    size = (args.batch_size, *shape)
    if kind == "ones":
        return torch.ones(size, dtype=torch.int64)
    if kind is not None and kind.startswith("int:"):
        return torch.randint(0, int(kind[4:]), size)
    if kind is not None:
        dt = getattr(torch, kind, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise CliError(f"bad --input {name}: kind {kind!r} is none of a floating dtype, int:VOCAB or ones")
        return torch.randn(size, dtype=dt)
    if args.int_input is not None:
        return torch.randint(0, args.int_input, size)
    return torch.randn(size, dtype=dtype)


def _notes(profile: Any, output: Path) -> list[str]:
    """Value layers, tied parameters and groups kept together, and a warning when graph.txt cannot record them."""
    values = sum(l.kind == "value" for l in profile.layers)
    lines = []
    if values:
        lines.append(f"value layers (no tensor in their output; recomputed where needed, never sent): {values}")
    for g in profile.tied:
        users = ", ".join(profile.layers[i].name for i in g.layers)
        lines.append(f"tied parameter {g.name} ({_size(g.bytes)}) shared by layers {users}")
    for k in profile.keep_together:
        lines.append(f"kept on one stage ({k.name}): {', '.join(profile.layers[i].name for i in k.layers)}")
    if output.suffix != ".json" and (values or profile.tied or profile.keep_together):
        lines.append("note: graph.txt cannot record layer kinds, tied parameters or groups kept together; write "
                     ".json to keep them")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 on an error)."""
    return run_cli(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
