"""Random fx-traceable models for property tests of planning (and, on top, of the runtime).

:func:`random_fx_model` draws a small *program* and returns a module whose ``forward`` runs it, with an
example input. ``torch.fx.symbolic_trace`` unrolls the program, so the traced graph has:

* modules (``nn.Linear``, ``nn.ReLU``, ``nn.LayerNorm``) and functions (``torch.tanh``, ``torch.relu``),
* branches and joins: any earlier tensor may be read again, so residual ``add``/``mul`` and ``torch.cat``
  join long-lived values,
* tuple-returning calls (``x.chunk(2, dim=1)``, ``x.split([k, F-k], dim=1)``) followed by ``getitem``,
* shape arithmetic: ``x.size(d)``, ``x.size()`` then ``getitem``, ``x.shape`` (``getattr``), ``floordiv`` of
  those ints, used by ``view``/``reshape`` of *other* tensors (``y.view(b, 2, n // 2)``), by ``torch.arange``
  and by scalar ``mul``. The ints may come from a far-away tensor or from the model input, so a value's
  tensor roots can be anything earlier.
* sometimes an unused shape value (a dead value layer).

Every tensor in the pool is 2-D ``(B, F)`` between instructions. The model returns one tensor: the ``cat``
of every tensor no instruction read, so every parameter gets a gradient. Deterministic for a given draw.

For checking plans of any fx model: :func:`plan_crossings` lists what really crosses each cut of a plan
under the runtime's contract (value layers are recomputed from their tensor roots where needed, tensors are
sent), :func:`run_stages` runs the traced model stage by stage with only those values handed over, and
checks every layer's output against an undivided run, and :func:`check_counted` checks that the search
counted them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_map

from partitioner.antichain import linearize
from partitioner.contract import contract
from partitioner.plan import Plan
from profiler.layers import has_tensor, layer_graph
from profiler.profile import Profile

__all__ = ["ProgramModel", "random_fx_model", "random_models", "Key", "plan_crossings", "run_stages", "check_counted"]

Key = tuple[str, int]
"""``("layer", i)`` for layer ``i``'s output, ``("input", k)`` for the model's ``k``-th input."""

# instruction opcodes and the pool entries they read/write are documented in ProgramModel.forward


class ProgramModel(nn.Module):
    """Runs a list of instructions over a pool of values (slot 0: the input). See :func:`random_fx_model`."""

    def __init__(self, program: list[tuple[Any, ...]], linears: list[tuple[int, int]], norms: list[int],
                 outputs: list[int]) -> None:
        super().__init__()
        self.program = program
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in linears)
        self.norms = nn.ModuleList(nn.LayerNorm(f) for f in norms)
        self.act = nn.ReLU()
        self.outputs = outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool: list[Any] = [x]
        for ins in self.program:
            op = ins[0]
            if op == "linear":
                pool.append(self.linears[ins[2]](pool[ins[1]]))
            elif op == "norm":
                pool.append(self.norms[ins[2]](pool[ins[1]]))
            elif op == "relu_module":
                pool.append(self.act(pool[ins[1]]))
            elif op == "tanh":
                pool.append(torch.tanh(pool[ins[1]]))
            elif op == "relu":
                pool.append(torch.relu(pool[ins[1]]))
            elif op == "add":
                pool.append(pool[ins[1]] + pool[ins[2]])
            elif op == "mul":
                pool.append(pool[ins[1]] * pool[ins[2]])
            elif op == "cat":
                pool.append(torch.cat([pool[ins[1]], pool[ins[2]]], dim=1))
            elif op == "chunk":  # two pool entries, both halves
                halves = pool[ins[1]].chunk(2, dim=1)
                pool.append(halves[0])
                pool.append(halves[1])
            elif op == "split":
                parts = pool[ins[1]].split([ins[2], ins[3]], dim=1)
                pool.append(parts[0])
                pool.append(parts[1])
            elif op == "size_dim":  # an int
                pool.append(pool[ins[1]].size(ins[2]))
            elif op == "size_all":  # torch.Size, then an int from it
                shape = pool[ins[1]].size()
                pool.append(shape[ins[2]])
            elif op == "shape_attr":
                pool.append(pool[ins[1]].shape[ins[2]])
            elif op == "floordiv":
                pool.append(pool[ins[1]] // ins[2])
            elif op == "view3":  # t.view(b, 2, h) with b, h ints from the pool, then back to 2-D
                t = pool[ins[1]].view(pool[ins[2]], 2, pool[ins[3]])
                if ins[4] == "sum":
                    pool.append(t.sum(dim=1))
                elif ins[4] == "reshape":
                    pool.append(t.reshape(pool[ins[2]], -1))
                else:
                    pool.append(t.transpose(1, 2).reshape(pool[ins[2]], -1))
            elif op == "arange_add":  # t + arange(n) with n an int equal to t's width
                pool.append(pool[ins[1]] + torch.arange(pool[ins[2]], dtype=pool[ins[1]].dtype))
            elif op == "scale":
                pool.append(pool[ins[1]] * pool[ins[2]])
            else:  # pragma: no cover - the generator only emits the opcodes above
                raise ValueError(f"unknown opcode {op!r}")
        return torch.cat([pool[i] for i in self.outputs], dim=1)


def random_fx_model(draw: Callable[[st.SearchStrategy[Any]], Any]) -> tuple[nn.Module, torch.Tensor]:
    """Draw a random :class:`ProgramModel` (3 to 16 instructions) and an example input ``(B, F0)``."""
    batch = draw(st.sampled_from([2, 3]))
    width0 = draw(st.sampled_from([4, 6, 8]))
    pool: list[tuple[str, int]] = [("t", width0)]  # ("t", width) tensors (B, width); ("i", value) ints
    program: list[tuple[Any, ...]] = []
    linears: list[tuple[int, int]] = []
    norms: list[int] = []
    read: set[int] = set()

    def tensors(pred: Callable[[int], bool] = lambda f: True) -> list[int]:
        return [i for i, (k, v) in enumerate(pool) if k == "t" and pred(v)]

    def ints(pred: Callable[[int], bool]) -> list[int]:
        return [i for i, (k, v) in enumerate(pool) if k == "i" and pred(v)]

    def pick(options: list[int]) -> int:
        # favour recent entries, but reach back to anything (long skip connections)
        i = options[-1] if draw(st.booleans()) else draw(st.sampled_from(options))
        read.add(i)
        return i

    def size_of(src: int, dim: int) -> int:
        """Append the int ``pool[src].size(dim)``, read one of three ways; return its value."""
        value = batch if dim == 0 else pool[src][1]
        program.append((draw(st.sampled_from(["size_dim", "size_all", "shape_attr"])), src, dim))
        pool.append(("i", value))
        return value

    steps = draw(st.integers(3, 16))
    for _ in range(steps):
        op = draw(st.sampled_from(["linear", "linear", "act", "add", "cat", "chunk", "split", "size",
                                   "size", "view3", "arange_add", "scale", "norm"]))
        if op == "linear":
            src = pick(tensors())
            out = draw(st.sampled_from([4, 6, 8, 12]))
            program.append(("linear", src, len(linears)))
            linears.append((pool[src][1], out))
            pool.append(("t", out))
        elif op == "norm":
            src = pick(tensors())
            program.append(("norm", src, len(norms)))
            norms.append(pool[src][1])
            pool.append(("t", pool[src][1]))
        elif op == "act":
            src = pick(tensors())
            program.append((draw(st.sampled_from(["tanh", "relu", "relu_module"])), src))
            pool.append(("t", pool[src][1]))
        elif op == "add":
            a = pick(tensors())
            same = tensors(lambda f, w=pool[a][1]: f == w)
            b = pick(same)
            program.append((draw(st.sampled_from(["add", "mul"])), a, b))
            pool.append(("t", pool[a][1]))
        elif op == "cat":
            a, b = pick(tensors()), pick(tensors())
            if pool[a][1] + pool[b][1] > 24:
                continue
            program.append(("cat", a, b))
            pool.append(("t", pool[a][1] + pool[b][1]))
        elif op == "chunk":
            even = tensors(lambda f: f % 2 == 0 and f >= 4)
            if not even:
                continue
            src = pick(even)
            program.append(("chunk", src))
            pool += [("t", pool[src][1] // 2)] * 2
        elif op == "split":
            wide = tensors(lambda f: f >= 3)
            src = pick(wide)
            k = draw(st.integers(1, pool[src][1] - 1))
            program.append(("split", src, k, pool[src][1] - k))
            pool += [("t", k), ("t", pool[src][1] - k)]
        elif op == "size":
            value = size_of(pick(tensors()), draw(st.sampled_from([0, 1])))
            if value % 2 == 0 and value >= 4 and draw(st.booleans()):
                program.append(("floordiv", len(pool) - 1, 2))
                pool.append(("i", value // 2))
        elif op == "view3":
            even = tensors(lambda f: f % 2 == 0)
            if not even:
                continue
            if not ints(lambda v: v == batch) or draw(st.booleans()):
                size_of(pick(tensors()), 0)
            candidates = [(t, h) for t in even for h in ints(lambda v: True) if pool[h][1] * 2 == pool[t][1]]
            if not candidates or draw(st.booleans()):
                t = pick(even)
                # the half width, from the size of some tensor as wide as t (maybe far away, maybe the input)
                u = pick(tensors(lambda f, w=pool[t][1]: f == w))
                size_of(u, 1)
                program.append(("floordiv", len(pool) - 1, 2))
                pool.append(("i", pool[t][1] // 2))
                h = len(pool) - 1
            else:
                t, h = draw(st.sampled_from(candidates))
            b = pick(ints(lambda v: v == batch))
            read.update((t, h))
            tail = draw(st.sampled_from(["sum", "reshape", "transpose"]))
            program.append(("view3", t, b, h, tail))
            pool.append(("t", pool[t][1] // 2 if tail == "sum" else pool[t][1]))
        elif op == "arange_add":
            candidates = [(t, n) for t in tensors() for n in ints(lambda v: True) if pool[n][1] == pool[t][1]]
            if not candidates:
                t = pick(tensors())
                size_of(pick(tensors(lambda f, w=pool[t][1]: f == w)), 1)
                candidates = [(t, len(pool) - 1)]
            t, n = draw(st.sampled_from(candidates))
            read.update((t, n))
            program.append(("arange_add", t, n))
            pool.append(("t", pool[t][1]))
        elif op == "scale":
            n_opts = ints(lambda v: True)
            if not n_opts:
                continue
            t = pick(tensors())
            n = pick(n_opts)
            program.append(("scale", t, n))
            pool.append(("t", pool[t][1]))
    if not linears:  # at least one parameter
        src = len(pool) - 1 if pool[-1][0] == "t" else tensors()[-1]
        read.add(src)
        program.append(("linear", src, 0))
        linears.append((pool[src][1], 4))
        pool.append(("t", 4))
    outputs = [i for i in tensors() if i not in read and i != 0] or [tensors()[-1]]
    model = ProgramModel(program, linears, norms, outputs)
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    example = torch.randn(batch, width0, generator=gen)
    return model, example


random_models = st.composite(random_fx_model)
"""``random_models()``: the hypothesis strategy of ``(model, example_input)`` pairs."""


# ----------------------------------------------------------------------------------------------------------
# what crosses each cut of a plan, and a stage-by-stage run that hands over only that


def _needs(profile: Profile, plan: Plan) -> list[set[Key]]:
    """Per stage: the values it reads and does not compute itself (value layers recomputed, recursively)."""
    preds = profile.predecessors()
    reads_input: list[list[int]] = [[] for _ in profile.layers]
    for k, inp in enumerate(profile.inputs):
        for r in inp.readers:
            reads_input[r].append(k)
    stage_of = plan.layer_to_stage
    needs: list[set[Key]] = [set() for _ in plan.stages]

    def need(t: int, i: int, seen: set[int]) -> None:
        for k in reads_input[i]:
            needs[t].add(("input", k))
        for p in preds[i]:
            if profile.layers[p].kind == "value":
                if p not in seen:  # recomputed in stage t from its own inputs
                    seen.add(p)
                    need(t, p, seen)
            elif stage_of[p] != t:
                needs[t].add(("layer", p))

    for t, stage in enumerate(plan.stages):
        seen: set[int] = set()
        for i in stage.layers:
            if profile.layers[i].kind == "tensor":
                need(t, i, seen)
    return needs


def plan_crossings(profile: Profile, plan: Plan) -> list[set[Key]]:
    """``result[t]``: the values sent into stage ``t`` (``t >= 1``; ``result[0]`` is empty).

    A value crosses the cut before stage ``t`` if it is produced before ``t`` (an input counts as produced
    before stage 0) and some stage ``u >= t`` needs it (passed on through the stages between).
    """
    needs = _needs(profile, plan)
    stage_of = plan.layer_to_stage
    out: list[set[Key]] = [set()]
    for t in range(1, plan.num_stages):
        later = set().union(*needs[t:])
        out.append({key for key in later if key[0] == "input" or stage_of[key[1]] < t})
    return out


def _all_values(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = _clone(out)  # later in-place layers (ReLU(inplace), +=) must not change it
            return out

    with torch.no_grad():
        _Record(gm).run(*inputs)
    return values


def run_stages(model: nn.Module, example: torch.Tensor, profile: Profile, plan: Plan) -> list[set[Key]]:
    """Run ``model`` stage by stage as the runtime would; assert every layer matches the undivided run.

    Stage ``t`` starts from the values :func:`plan_crossings` sends it (stage 0: the model inputs it reads),
    computes its tensor layers in order and recomputes any value layer it reads on demand. A value it needs
    but neither receives nor can recompute fails the assertion. Also asserts that value layers' outputs
    hold no tensor and crossing values hold one. Returns the crossings.
    """
    graph = layer_graph(model)
    gm = graph.graph_module
    assert gm is not None and graph.names == [l.name for l in profile.layers]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = graph.nodes()
    index = {n: i for i, n in enumerate(nodes)}
    real = _all_values(gm, (example,))
    for i, layer in enumerate(profile.layers):
        assert has_tensor(real[layer.name]) == (layer.kind == "tensor"), f"layer {layer.name} has the wrong kind"
    crossings = plan_crossings(profile, plan)
    stage_of = plan.layer_to_stage
    for t, stage in enumerate(plan.stages):
        env: dict[torch.fx.Node, Any] = {}
        received = crossings[t] if t else {("input", k) for k in range(len(placeholders))}
        for kind, i in received:
            node = placeholders[i] if kind == "input" else nodes[i]
            assert kind == "input" or has_tensor(real[node.name]), f"{node.name} crosses but holds no tensor"
            env[node] = _clone(real[node.name])

        def get(node: torch.fx.Node) -> Any:
            if node in env:
                return env[node]
            i = index.get(node)
            assert i is not None and profile.layers[i].kind == "value", (
                f"stage {t} reads {node.name}, which it neither computes nor receives"
            )
            env[node] = _run(gm, node, get)
            return env[node]

        with torch.no_grad():
            for i in stage.layers:
                if profile.layers[i].kind == "tensor":
                    node = nodes[i]
                    env[node] = _run(gm, node, get)
                    assert stage_of[i] == t
                    _same(env[node], real[node.name], node.name)
    return crossings


def check_counted(profile: Profile, plan: Plan, crossings: list[set[Key]]) -> None:
    """Assert that the search counted every value in ``crossings`` (see :func:`plan_crossings`) at its cut.

    The cut before each stage must be an antichain state of the search; the layers crossing it must be in
    that state's crossing set (inputs: read by a layer outside it) and their bytes at most the bytes counted.
    """
    con = contract(profile)
    states = linearize(con.profile)
    position = {old: new for new, part in enumerate(con.members) for old in part}
    stage_of = plan.layer_to_stage
    by_downset = {d: k for k, d in enumerate(states.downsets)}
    for t in range(1, plan.num_stages):
        down = tuple(sorted({position[i] for i in con.tensor_layers if stage_of[i] < t}))
        assert down in by_downset, f"the cut before stage {t} is no antichain state of the search"
        k = by_downset[down]
        counted: set[Key] = {("layer", old) for i in states.crossing[k] for old in con.members[i]}
        for x, inp in enumerate(con.profile.inputs):
            if set(inp.readers) - set(down):
                counted.add(("input", x))
        missing = crossings[t] - counted
        assert not missing, f"cut before stage {t}: {sorted(missing)} cross but are not counted"
        real = sum(profile.layers[i].activation_bytes if kind == "layer" else profile.inputs[i].bytes
                   for kind, i in crossings[t])
        assert real <= states.output_bytes[k] * (1 + 1e-12)


def _clone(value: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _run(gm: torch.fx.GraphModule, node: torch.fx.Node, get: Callable[[torch.fx.Node], Any]) -> Any:
    args = torch.fx.node.map_arg(node.args, get)
    kwargs = torch.fx.node.map_arg(node.kwargs, get)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "get_attr":
        value: Any = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value
    raise AssertionError(f"unexpected node {node.name} ({node.op})")


def _same(a: Any, b: Any, name: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b), f"{name} differs"
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{name} differs"
        for x, y in zip(a, b):
            _same(x, y, name)
    else:
        assert a == b, f"{name} differs: {a!r} != {b!r}"
