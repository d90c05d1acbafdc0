"""One-line messages for the command line's parse errors: the bad value, and what to write.

jsonargparse reports a bad recipe key or value as a block of lines (``Parser key
"model": Does not validate against any of the Union subtypes ...``); argparse prints
its usage before the error. :func:`explain_jsonargparse` reduces such a block to one
line naming the key (and the closest valid key, by :mod:`difflib`) or the value (and
the accepted ones); :class:`OneLineArgumentParser` makes argparse errors one line too.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

__all__ = [
    "OneLineArgumentParser",
    "UsageError",
    "closest",
    "explain_jsonargparse",
    "first_line",
    "parser_keys",
]


class UsageError(ValueError):
    """A bad command-line argument; the message says how to fix it."""


def first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message (library errors can span many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def closest(word: str, valid: Iterable[str]) -> str | None:
    """The entry of ``valid`` most like ``word`` (difflib ratio >= 0.6), or None.

    A dotted ``word`` (``trainer.max_step``) is compared with the keys under the same
    head (``trainer.*``) by its last part, when there are such keys.
    """
    pool = sorted(set(valid))
    if "." in word:
        head, tail = word.rsplit(".", 1)
        siblings = [k[len(head) + 1 :] for k in pool if k.startswith(head + ".")]
        if siblings:
            near = difflib.get_close_matches(tail, siblings, n=1, cutoff=0.6)
            return f"{head}.{near[0]}" if near else None
    match = difflib.get_close_matches(word, pool, n=1, cutoff=0.6)
    return match[0] if match else None


def parser_keys(parser: Any) -> list[str]:
    """The dotted option keys a jsonargparse parser accepts (``trainer.max_steps``, ...)."""
    keys = []
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", "")
        if dest and dest not in ("help", "config", "print_config"):
            keys.append(dest)
    return keys


def _init_keys(class_path: str) -> list[str]:
    """The keyword arguments that the class at ``class_path`` takes (empty if unknown)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if p.name != "self" and p.kind not in kinds]


_NOT_ACCEPTED = re.compile(r"does not accept option '([^']+)'|[Kk]ey \"([^\"]+)\" is not expected")
_CLASS_OPTION = re.compile(
    r"Problem with given class_path '([^']+)':\s*\n\s*Option '([^']+)' is not accepted"
)
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_GIVEN = re.compile(r"^\s*Given value: (.*)$", re.M)
_LITERAL = re.compile(r"Literal\[([^\]]*)\]")


def explain_jsonargparse(message: str, keys: Iterable[str], command: str) -> str:
    """One line for a jsonargparse error ``message`` of ``bb-lightning command``.

    ``keys`` are the subcommand's valid dotted keys (:func:`parser_keys`).
    """
    keys = list(keys)
    help_hint = f"(see bb-lightning {command} --help)"
    m = _CLASS_OPTION.search(message)
    if m:
        class_path, option = m.groups()
        where = _PARSER_KEY.search(message)
        key = f"{where.group(1)}.init_args.{option}" if where else option
        valid = _init_keys(class_path)
        near = closest(option, valid)
        hint = f"did you mean {near!r}?" if near else f"valid keys: {', '.join(valid)}"
        return f"unknown key {key!r}: {class_path} takes no {option!r}; {hint} {help_hint}"
    m = _NOT_ACCEPTED.search(message)
    if m:
        key = m.group(1) or m.group(2)
        head, _, rest = key.partition(".")
        heads = {k.split(".")[0] for k in keys}
        near_head = closest(head, heads) if head not in heads else None
        near = ".".join(filter(None, [near_head, rest])) if near_head else closest(key, keys)
        if near is None:
            return f"unknown key {key!r}: no valid key is close; bb-lightning {command} --help lists them"
        return f"unknown key {key!r}: did you mean {near!r}? {help_hint}"
    m = _PARSER_KEY.search(message)
    given = _GIVEN.search(message)
    if m and given:
        key, value = m.group(1), given.group(1).strip()
        choices = [
            c.strip().strip("'\"") for group in _LITERAL.findall(message) for c in group.split(",")
        ]
        if choices:
            near = closest(value, choices)
            near_text = f" (closest: {near!r})" if near else ""
            return (
                f"{key}={value!r} is not valid: use one of {', '.join(dict.fromkeys(choices))}"
                f"{near_text} {help_hint}"
            )
        types = re.findall(r"Expected an? (?:<class '([\w.]+)'>|([\w.\[\], ]+))", message)
        wanted = [a or b.strip() for a, b in types]
        wanted = [{"NoneType": "null"}.get(w, w) for w in dict.fromkeys(wanted)]
        if wanted:
            reason = f"expected {' or '.join(wanted)}"
        else:
            details = [line.strip(" -") for line in message.splitlines()[1:] if line.strip()]
            reason = next((d for d in details if not d.startswith(("Given", "Subtypes"))), "")
        return f"{key}={value!r} is not valid: {reason} {help_hint}".replace("  ", " ")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return f"{' '.join(lines[:2]) if lines else message} {help_hint}"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            near = closest(m.group(1), [c.strip(" '") for c in m.group(2).split(",")])
            if near:
                message += f"; did you mean {near!r}?"
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
