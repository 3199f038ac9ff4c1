"""The canonical stream's words in a fused Triton kernel: one Philox block per four counters.

An Inductor pointwise body sees one element, so a lowering made of ``ops.*`` computes a
whole Philox4x32-10 block for every element and keeps one of its four words. Here the
word of counter ``base + rel`` is one op, ``ops.compile_rng_word(seed, base, rel)``, which a
Triton kernel emits as a call of a helper below (added to the kernel's source, so Inductor's caches
and compile workers see it): where every group of four lanes of the kernel's 1-D block
holds the counters of one aligned Philox block (``4k .. 4k+3``, in order - a stream, a
row-major window, the batch rows of a step), the program computes one block per group and
hands out its four words; otherwise (a transposed or strided layout, an offset that is not
a multiple of four, a 2-D tile) each element computes its own block and takes its lane,
as before. The check is made per program at run time on the counters themselves, so the
values are the contract's either way; where the kernel computed the counters as a number
plus its block's index (read back from its source: consecutive lanes by construction),
only the program's first counter is checked, a scalar (tested bitwise in
Triton's interpreter against the eager kernels, and compiled for sm_90 offline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compile_rng import stream
from compile_rng._torch import inductor_internals

#: the op's name among Inductor's ``ops``
OP = "compile_rng_word"

_MASK30 = (1 << 30) - 1  # a block number's high word: blocks are counters >> 2, below 2**62


def _rounds(c: list[str], k: list[str]) -> list[str]:
    """Philox4x32's rounds as Triton lines on the uint32 values named ``c`` (counter) and
    ``k`` (key), in place (Random123's rounds; the key bumped between rounds)."""
    m0, m1 = stream.PHILOX_M0, stream.PHILOX_M1
    lines = []
    for r in range(stream.PHILOX_ROUNDS):
        if r:
            lines += [f"{k[0]} = {k[0]} + {stream.PHILOX_W0}", f"{k[1]} = {k[1]} + {stream.PHILOX_W1}"]
        lines.append(
            f"{c[0]}, {c[1]}, {c[2]}, {c[3]} = tl.umulhi({c[2]}, {m1}) ^ {c[1]} ^ {k[0]}, {c[2]} * {m1}, "
            f"tl.umulhi({c[0]}, {m0}) ^ {c[3]} ^ {k[1]}, {c[0]} * {m0}"
        )
    return lines


def _block_lines(c: list[str], k: list[str], block: str, seed: str) -> list[str]:
    """Triton lines leaving in ``c`` the four words of Philox block ``block`` (a uint64)
    under ``seed`` (a uint64), its key words named ``k``."""
    return [
        f"{k[0]} = ({seed} & {stream.MASK32}).to(tl.uint32)",
        f"{k[1]} = ({seed} >> 32).to(tl.uint32)",
        f"{c[0]} = ({block} & {stream.MASK32}).to(tl.uint32)",
        f"{c[1]} = (({block} >> 32) & {_MASK30}).to(tl.uint32)",
        f"{c[2]} = tl.zeros_like({c[0]})",
        f"{c[3]} = tl.zeros_like({c[0]})",
        *_rounds(c, k),
    ]


def _lane_lines(name: Callable[[str], str], seed: str, n: str) -> list[str]:
    """Triton lines computing ``name("word")``: word ``n & 3`` of block ``n >> 2`` under
    ``seed`` (int64s holding uint64s), an int64 in ``[0, 2**32)``, a block per lane; every
    value they name is ``name(...)`` of a local name."""
    c, k = [name(f"c{i}") for i in range(4)], [name("k0"), name("k1")]
    u, s, lane = name("n"), name("seed"), name("lane")
    return [
        f"{u} = ({n}).to(tl.uint64, bitcast=True)",
        f"{s} = ({seed}).to(tl.uint64, bitcast=True)",
        *_block_lines(c, k, f"({u} >> 2)", s),
        f"{lane} = {u} & 3",
        f"{name('word')} = tl.where({lane} == 0, {c[0]}, tl.where({lane} == 1, {c[1]}, "
        f"tl.where({lane} == 2, {c[2]}, {c[3]}))).to(tl.int64)",
    ]


def _function(header: str, doc: str, lines: list[str], result: str) -> str:
    """A ``@triton.jit`` helper's template (Inductor ``str.format``s it with its ``name``)."""
    body = "\n".join(f"    {line}" for line in [f'"""{doc}"""', *lines, f"return {result}"])
    return f"\n@triton.jit\ndef {{name}}{header}:\n" + body.replace("{", "{{").replace("}", "}}") + "\n"


_LANES = _function(
    "(seed, n)", "compile_rng: word n & 3 of the Philox block n >> 2 under seed, a block per lane.",
    _lane_lines(lambda local: local, "seed", "n"), "word",
)

# LANES: the name _LANES got in the kernel
_SPLIT = "tl.split(tl.split(tl.reshape({}, [BLOCK // 4, 2, 2]))[0])[0]"
_WORD = (
    "\n@triton.jit\ndef {name}(seed, n, BLOCK: tl.constexpr):\n"
    + "\n".join(f"    {line}" for line in [
        '"""compile_rng: word n & 3 of the Philox block n >> 2 under seed (int64s holding uint64s), an',
        "int64 in [0, 2**32); one block per four lanes where the program's lanes hold whole blocks",
        'in order (checked here, on the counters), else a block per lane."""',
        "if BLOCK >= 4 and BLOCK % 4 == 0:",
        "    u = n.to(tl.uint64, bitcast=True)",
        "    p, q = tl.split(tl.reshape(u, [BLOCK // 4, 2, 2]))",
        "    n0, n2 = tl.split(p)",
        "    n1, n3 = tl.split(q)",
        "    aligned = ((n0 & 3) == 0) & (n1 == n0 + 1) & (n2 == n0 + 2) & (n3 == n0 + 3)",
        "    if tl.min(aligned.to(tl.int32), axis=0) == 1:",
        "        s = " + _SPLIT.format("seed.to(tl.uint64, bitcast=True)").replace("{", "{{").replace("}", "}}"),
        *(f"        {line}" for line in _block_lines(["w0", "w1", "w2", "w3"], ["k0", "k1"], "(n0 >> 2)", "s")),
        "        word = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK]).to(tl.int64)",
        "    else:",
        "        word = LANES(seed, n)",
        "else:",
        "    word = LANES(seed, n)",
        "return word",
    ]) + "\n"
)


#: The words of a program whose lanes' counters are consecutive: ``first + i`` for lane
#: ``i`` (the kernel computed them as a number plus its block's index), seed and first
#: scalars. No lane is checked: one branch on ``first``, and both sides give their four words
#: per group of four lanes in the same layout, joined once (a branch merging the joined
#: words with a block per lane moved them through shared memory: 13 barriers in a dropout).
_FROM_FIRST = (
    "\n@triton.jit\ndef {name}(seed, first, BLOCK: tl.constexpr):\n"
    + "\n".join(f"    {line}" for line in [
        '"""compile_rng: the words of counters first + i, i in [0, BLOCK) (seed and first: scalar',
        "int64s holding uint64s), int64s in [0, 2**32): one Philox block per four lanes where first",
        'is a multiple of four, else a block per lane."""',
        "if BLOCK >= 4 and BLOCK % 4 == 0:",
        "    g = first.to(tl.uint64, bitcast=True) + 4 * tl.arange(0, BLOCK // 4).to(tl.uint64)",
        "    if (first & 3) == 0:",
        "        s = seed.to(tl.uint64, bitcast=True)",
        *(f"        {line}" for line in _block_lines(["w0", "w1", "w2", "w3"], ["k0", "k1"], "(g >> 2)", "s")),
        "    else:",
        *(f"        w{j} = LANES(seed, (g + {j}).to(tl.int64, bitcast=True)).to(tl.uint32)" for j in range(4)),
        "    word = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK]).to(tl.int64)",
        "else:",
        "    word = LANES(seed, first + tl.arange(0, BLOCK))",
        "return word",
    ]) + "\n"
)


def codegen(seed: Any, base: Any, rel: Any) -> str:
    """The Triton expression of ``ops.compile_rng_word(seed, base, rel)`` in the kernel being
    generated: a call of the helpers where the kernel's source holds them - with no check
    of the lanes where the kernel computed them consecutive
    (:func:`~compile_rng._torch.inductor_internals.triton_consecutive_counters`) - else (a
    template's epilogue, rendered from its template) the per-lane lines in its body."""
    n = f"({base} + {rel})"
    if not inductor_internals.triton_kernel_holds_helpers():
        prefix = inductor_internals.triton_new_name("compile_rng_")
        inductor_internals.triton_compute_lines(_lane_lines(lambda local: f"{prefix}_{local}", str(seed), n))
        return f"{prefix}_word"
    lanes = inductor_internals.triton_helper(_LANES, "compile_rng_lanes")
    run = inductor_internals.triton_consecutive_counters(seed, base, rel)
    if run is not None:
        name = inductor_internals.triton_helper(_FROM_FIRST.replace("LANES", lanes), "compile_rng_words_from")
        return f"{name}({run[0]}, {run[1]}, {run[2]})"
    name = inductor_internals.triton_helper(_WORD.replace("LANES", lanes), "compile_rng_word")
    return f"{name}({seed}, {n}, {inductor_internals.triton_block() or 1})"


#: Adds ``ops.compile_rng_word`` to Inductor (idempotent): :mod:`compile_rng.installation`
#: offers it when this module is imported, and again after ``uninstall()`` took it back.
_installer: Callable[[], None] | None = None


def set_installer(installer: Callable[[], None]) -> None:
    """``installer()`` makes ``ops.compile_rng_word`` an op of Inductor (:func:`codegen`)."""
    global _installer
    _installer = installer


def word(seed: Any, base: Any, rel: Any) -> Any:
    """``ops.compile_rng_word``: the stream's word of counter ``base + rel`` (int64s holding
    uint64s, the sum wrapping; ``rel`` an index expression of the kernel's) under ``seed``,
    an int64 in ``[0, 2**32)``."""
    if _installer is None:
        raise RuntimeError("compile_rng internal error: Inductor's compile_rng_word op was never offered")
    _installer()
    return getattr(inductor_internals.inductor_ops, OP)(seed, base, rel)
