"""ListOps grammar: the fixed vocabulary, tokenising and evaluating an expression.

Vocabulary: ``0`` padding, ``1..10`` digits 0..9, ``11..14`` the operators ``[MIN``, ``[MAX``,
``[MED``, ``[SM``, ``15`` the closing bracket ``]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PAD", "CLOSE", "TOKENS", "OPERATORS", "FIRST_OP", "VOCAB_SIZE", "NUM_CLASSES", "encode", "decode",
           "evaluate", "tree_depth"]

PAD = 0
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
TOKENS = ("<pad>",) + tuple(str(d) for d in range(10)) + OPERATORS + ("]",)
CLOSE = TOKENS.index("]")
FIRST_OP = TOKENS.index("[MIN")
VOCAB_SIZE = len(TOKENS)  # 16
NUM_CLASSES = 10
_TOKEN_ID = {t: i for i, t in enumerate(TOKENS) if i != PAD}


def encode(source: str) -> list[int]:
    """Token ids of a source string (whitespace separated; ``(`` and ``)`` are ignored)."""
    out = []
    for tok in source.replace("(", " ").replace(")", " ").split():
        if tok not in _TOKEN_ID:
            raise ValueError(f"listops: unknown token {tok!r}; the vocabulary is {list(TOKENS[1:])}")
        out.append(_TOKEN_ID[tok])
    return out


def decode(ids) -> str:
    """Source string of token ids (padding ids are skipped)."""
    return " ".join(TOKENS[int(i)] for i in ids if int(i) != PAD)


def _apply(op: str, values: list[int]) -> int:
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return int(np.median(values))
    return sum(values) % 10


def evaluate(ids) -> int:
    """Value of one expression given as token ids (or a source string); a plain stack
    evaluator, the oracle for the vectorised generator."""
    if isinstance(ids, str):
        ids = encode(ids)
    stack: list[tuple[str, list[int]]] = []
    result = None
    for i in ids:
        i = int(i)
        if i == PAD:
            continue
        if result is not None:
            raise ValueError("listops: tokens after the end of the expression")
        tok = TOKENS[i]
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == "]":
            if not stack:
                raise ValueError("listops: ']' without an open list")
            op, values = stack.pop()
            if not values:
                raise ValueError(f"listops: empty list {op} ]")
            value = _apply(op, values)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            value = int(tok)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
    if stack or result is None:
        raise ValueError("listops: incomplete expression")
    return result


def tree_depth(ids) -> tuple[int, int]:
    """``(depth, widest list)`` of an expression: depth counts the digit level (a lone digit has
    depth 1, ``[SM 1 2 ]`` depth 2); widest is the largest argument count of any list."""
    depth = widest = 0
    stack: list[int] = []
    for i in ids:
        i = int(i)
        if FIRST_OP <= i < CLOSE:
            if stack:
                stack[-1] += 1
            stack.append(0)
            depth = max(depth, len(stack))
        elif i == CLOSE:
            widest = max(widest, stack.pop())
        elif i != PAD:
            if stack:
                stack[-1] += 1
            depth = max(depth, len(stack) + 1)
    return depth, widest
