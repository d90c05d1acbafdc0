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
    "explain_instantiation",
    "explain_jsonargparse",
    "first_line",
    "parser_keys",
    "with_key",
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
    if _PARSER_KEY.search(message) and (_GIVEN.search(message) or _GOT.search(message)):
        return _explain_value(message, command)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return f"{' '.join(lines[:2]) if lines else message} {help_hint}"


_NESTED = re.compile(r"^NestedArg\(key='([^']*)', val=(.*)\)$")
_GOT = re.compile(r"Got value: (.*)$")
_ENUM = re.compile(r"Expected a member of <enum '\w+'>: \{([^}]*)\}")
_TYPE = re.compile(r"Expected an? (?:<class '([\w.]+)'>|([\w.\[\], ]+))")
_NOT_LEAF = ("Given value", "Subtypes:", "Errors:", "Parser key", "Problem with given class_path",
             "Does not validate")  # fmt: skip
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "true or false", "NoneType": "null"}  # fmt: skip


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" -"))


def _leaves(message: str) -> list[str]:
    """The deepest lines of a nested jsonargparse message that are not its scaffolding:
    what the innermost check said (expected types, a constructor's own message)."""
    lines = [ln for ln in message.splitlines() if ln.strip()]
    leaves = [ln for ln in lines if not ln.strip(" -").startswith(_NOT_LEAF)]
    if not leaves:
        return []
    deepest = max(_indent(ln) for ln in leaves)
    return [ln.strip(" -").strip() for ln in leaves if _indent(ln) == deepest]


def _show(value: str) -> str:
    """A value as the user wrote it: numbers bare, anything else quoted."""
    try:
        float(value)
    except ValueError:
        return repr(value)
    return value


def _key_and_value(message: str) -> tuple[str, str | None]:
    """The dotted key (``model.init_args.max_new_tokens``) and the value given there."""
    lines = message.splitlines()
    chain = [m.group(1) for ln in lines for m in [_PARSER_KEY.search(ln)] if m]
    given = [(_indent(ln), m.group(1).strip()) for ln in lines for m in [_GIVEN.match(ln)] if m]
    outer = min(given)[1] if given else ""
    nested = _NESTED.match(outer)
    if nested and chain:  # --model.init_args.max_new_tokens=-3 on the command line
        return f"{chain[0]}.init_args.{nested.group(1)}", nested.group(2).strip("'\"")
    key = chain[0] + (".init_args." + ".".join(chain[1:]) if len(chain) > 1 else "")
    got = [m.group(1).strip() for ln in lines for m in [_GOT.search(ln)] if m]
    inner = max(given)[1] if given else None
    return key, (got[-1] if got else inner)


def _explain_value(message: str, command: str) -> str:
    """One line for a bad value at a (nested) key: the key, the value, what is accepted."""
    help_hint = f"(see bb-lightning {command} --help)"
    key, value = _key_and_value(message)
    whole = value is None or value.startswith(("Namespace(", "NestedArg(", "{"))
    shown = "" if whole else f"={_show(value)}"  # type: ignore[arg-type]
    leaves = _leaves(message)
    own = [ln for ln in leaves if not ln.startswith("Expected a")]
    if own:  # a check of the class's own (a constructor, a dataclass' __post_init__)
        return f"{key}{shown}: {_without_name(own[0])} {help_hint}"
    choices = [c.strip().strip("'\"") for ln in leaves for g in _LITERAL.findall(ln)
               for c in g.split(",")]  # fmt: skip
    choices += [c.strip() for ln in leaves for m in [_ENUM.search(ln)] if m
                for c in m.group(1).split(",")]  # fmt: skip
    if choices:
        near = closest(value or "", choices) or closest((value or "").upper(), choices)
        near_text = f" (closest: {near!r})" if near else ""
        null = " or null" if any("NoneType" in ln for ln in leaves) else ""
        return (
            f"{key}{shown} is not valid: use one of {', '.join(dict.fromkeys(choices))}{null}"
            f"{near_text} {help_hint}"
        )
    wanted = [a or b.strip() for ln in leaves for a, b in _TYPE.findall(ln)]
    words = [_TYPE_WORDS.get(w, w) for w in dict.fromkeys(wanted)]
    reason = f"expected {' or '.join(words)}" if words else "; ".join(leaves)
    return f"{key}{shown} is not valid: {reason} {help_hint}".replace("  ", " ")


_OWN_NAME = re.compile(r"^(?:[A-Z]\w*\.)?([a-z_]\w*(?:\[\d+\])?)\s?=\s?(\S+?)[:;,]?(?=\s|$)")


def with_key(prefix: str, text: str) -> str:
    """A check's message ``name=value ...`` as ``<prefix>name=value: ...`` (the recipe key);
    a message without a leading ``name=value`` as ``<prefix without its dot>: text``."""
    m = _OWN_NAME.match(text)
    if m is None:
        return f"{prefix.rstrip('.')}: {text}"
    return f"{prefix}{m.group(1)}={m.group(2)}: {_without_name(text)}"


def _without_name(text: str) -> str:
    """A check's message without its leading ``name=value`` (the caller names the key)."""
    m = _OWN_NAME.match(text)
    return text[m.end() :].strip() if m else text


def explain_instantiation(message: str, config: Any, command: str) -> str | None:
    """One line for a class's own ``ValueError`` that jsonargparse wrapped while building
    the classes of a recipe ("Does not validate against any of the Union subtypes"), with
    the recipe key in front; None when ``message`` is not such a wrapper."""
    if not message.startswith("Does not validate against any of the Union subtypes"):
        return None
    own = [ln for ln in _leaves(message) if not ln.startswith("Expected a")]
    if not own:
        return None
    text, hint = own[0], f"(see bb-lightning {command} --help)"
    m = _OWN_NAME.match(text)
    leaves = _flatten(config)
    heads = [k[: -len(".class_path")] for k, v in leaves.items()
             if k.endswith(".class_path") and f"class_path='{v}'" in message]  # fmt: skip
    where = f"{heads[0]}: " if heads else ""
    if m is None or not heads:
        return f"{where}{text} {hint}"
    name, value = m.group(1).split("[")[0], m.group(2)
    keys = [k for k in leaves if any(k.startswith(h + ".init_args.") for h in heads)
            and k.rsplit(".", 1)[-1] == name]  # fmt: skip
    keys = [k for k in keys if str(leaves[k]) == value] or keys
    if not keys:
        return f"{where}{text} {hint}"
    index = m.group(1)[len(name) :]
    return f"{keys[0]}{index}={value}: {_without_name(text)} {hint}"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a parsed recipe (namespaces and dicts) and their values."""
    items: Any = None
    if isinstance(value, dict):
        items = value.items()
    elif hasattr(value, "__dict__") and type(value).__name__ == "Namespace":
        items = vars(value).items()
    if items is None:
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


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
