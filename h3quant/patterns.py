"""User-written regular expressions, matched in bounded time.

``--layer``, ``--include``, ``--exclude`` and recipe rules name layers with a regular expression
(``re.search`` semantics on the layer name). A backtracking engine can take exponential time on
a pattern such as ``(.|.|.|.)*Z$``, so every user pattern goes through ``compile_pattern``:

* it is at most ``h3quant.limits.MAX_PATTERN_CHARS`` characters;
* backreferences, lookarounds, conditionals, possessive repeats, atomic groups and inline flags
  are refused (usage errors naming the rule): they are never needed to name layers;
* a pattern with at most two repeats (``*``, ``+``, ``?``, ``{m,n}``) and no repeat inside
  another is matched by Python's ``re`` (its backtracking is then at worst cubic in the name's
  length, and names are short);
* any other pattern is matched by a small automaton built here from the parsed pattern, which
  follows every alternative at once (time linear in the name's length times the pattern's
  size, no backtracking). Its size is bounded by ``MAX_STATES``; a pattern whose counted
  repeats expand past it is refused.

The parse is Python's own (``re._parser``), so what a pattern means is exactly what ``re``
gives it; only the way it is matched differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from h3quant.errors import UsageError
from h3quant.limits import MAX_PATTERN_CHARS

try:  # Python 3.11+
    from re import _constants as _c, _parser as _p  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _c  # type: ignore[no-redef,unused-ignore]
    import sre_parse as _p  # type: ignore[no-redef,unused-ignore]

MAX_STATES = 4000  # automaton states of one pattern (counted repeats expanded)

_REFUSED = {
    _c.GROUPREF: "a backreference", _c.GROUPREF_EXISTS: "a conditional group",
    _c.ASSERT: "a lookahead/lookbehind", _c.ASSERT_NOT: "a negative lookahead/lookbehind",
}
for _name, _why in (("POSSESSIVE_REPEAT", "a possessive repeat"),
                    ("ATOMIC_GROUP", "an atomic group"),
                    ("GROUPREF_IGNORE", "a backreference"),
                    ("GROUPREF_LOC_IGNORE", "a backreference"),
                    ("GROUPREF_UNI_IGNORE", "a backreference")):
    if hasattr(_c, _name):
        _REFUSED[getattr(_c, _name)] = _why
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT)


class Pattern:
    """A checked user pattern: ``search(name)`` is truthy when ``re.search`` would match."""

    def __init__(self, text: str, matcher: Callable[[str], bool], engine: str):
        self.pattern = text
        self._match = matcher
        self.engine = engine  # "re" or "automaton"

    def search(self, name: str) -> bool:
        return self._match(name)

    def __repr__(self) -> str:
        return f"Pattern({self.pattern!r}, engine={self.engine})"


def compile_pattern(text: str, where: str, error: type[Exception] = UsageError) -> Pattern:
    """``text`` checked and compiled; ``error(reason)`` (a usage error) naming ``where`` when
    it is invalid, too long or uses a construct refused above."""
    if not isinstance(text, str) or not text:
        raise error(f"{where}: the layer pattern must be a non-empty regular expression")
    if len(text) > MAX_PATTERN_CHARS:
        raise error(f"{where}: the pattern is {len(text):,} characters; the limit is "
                    f"{MAX_PATTERN_CHARS:,} (h3quant.limits.MAX_PATTERN_CHARS)")
    try:
        compiled = re.compile(text)
        tree = _p.parse(text)
    except (re.error, RecursionError, OverflowError) as exc:
        raise error(f"{where}: {text!r} is not a valid regular expression: {exc}") from None
    flags = tree.state.flags & ~(re.UNICODE | getattr(_c, "SRE_FLAG_UNICODE", 0))
    if flags:
        raise error(f"{where}: {text!r}: inline flags such as (?i) are not supported in "
                    "layer patterns")
    stats = _Stats()
    try:
        _scan(tree, stats, 0)
    except _Refused as exc:
        raise error(f"{where}: {text!r} uses {exc.args[0]}, which layer patterns do not "
                    "support (matching time could grow without bound); name the layers with "
                    "literals, character classes and simple repeats") from None
    if stats.nested == 0 and stats.repeats <= 2:
        return Pattern(text, lambda name: compiled.search(name) is not None, "re")
    try:
        nfa = _Builder().build(tree)
    except _TooBig:
        raise error(f"{where}: {text!r} expands to more than {MAX_STATES:,} matching states "
                    "(large counted repeats); simplify it") from None
    return Pattern(text, nfa.search, "automaton")


# ------------------------------------------------------------------------- the structural scan
class _Refused(Exception):
    pass


class _TooBig(Exception):
    pass


class _Stats:
    def __init__(self) -> None:
        self.repeats = 0  # repeats of any kind
        self.nested = 0  # repeats (max > 1) holding a repeat or an alternation


def _scan(items, stats: _Stats, depth: int) -> bool:
    """Walk the parse; True when ``items`` hold a repeat (max > 1) or an alternation."""
    found = False
    for op, av in items:
        if op in _REFUSED:
            raise _Refused(_REFUSED[op])
        if op in _REPEATS:
            lo, hi, body = av
            stats.repeats += 1
            inner = _scan(body, stats, depth + 1)
            if hi > 1 and inner:
                stats.nested += 1
            found = found or hi > 1 or inner
        elif op is _c.SUBPATTERN:
            group, add, sub, body = av
            if add or sub:
                raise _Refused("inline flags")
            found = _scan(body, stats, depth + 1) or found
        elif op is _c.BRANCH:
            for alt in av[1]:
                _scan(alt, stats, depth + 1)
            found = True
    return found


# ------------------------------------------------------------------------------ the automaton
# States: ("char", pred, next) | ("split", a, b) | ("assert", kind, next) | ("match",)
class _NFA:
    def __init__(self, states: list, start: int):
        self.states = states
        self.start = start

    def _close(self, ids, name: str, pos: int, out: set) -> None:
        stack = list(ids)
        st = self.states
        while stack:
            i = stack.pop()
            if i in out:
                continue
            out.add(i)
            s = st[i]
            kind = s[0]
            if kind == "split":
                stack.append(s[1])
                stack.append(s[2])
            elif kind == "assert":
                if _at(s[1], name, pos):
                    stack.append(s[2])

    def search(self, name: str) -> bool:
        st = self.states
        current: set = set()
        for pos in range(len(name) + 1):
            self._close([self.start], name, pos, current)  # unanchored: a start at every pos
            if any(st[i][0] == "match" for i in current):
                return True
            if pos == len(name):
                break
            ch = name[pos]
            nxt = [st[i][2] for i in current if st[i][0] == "char" and st[i][1](ch)]
            current = set()
            if nxt:
                self._close(nxt, name, pos + 1, current)
        return any(st[i][0] == "match" for i in current)


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _at(kind, name: str, pos: int) -> bool:
    n = len(name)
    if kind in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING):
        return pos == 0
    if kind == _c.AT_END:
        return pos == n or (pos == n - 1 and name[-1] == "\n")
    if kind == _c.AT_END_STRING:
        return pos == n
    before = pos > 0 and _is_word(name[pos - 1])
    after = pos < n and _is_word(name[pos])
    if kind == _c.AT_BOUNDARY:
        return before != after
    if kind == _c.AT_NON_BOUNDARY:
        return before == after
    raise _Refused(f"the anchor {kind}")


_CATEGORIES: dict = {
    _c.CATEGORY_DIGIT: lambda ch: ch.isdecimal(),
    _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    _c.CATEGORY_SPACE: lambda ch: ch.isspace(),
    _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    _c.CATEGORY_WORD: _is_word,
    _c.CATEGORY_NOT_WORD: lambda ch: not _is_word(ch),
}


def _is_char(c: str) -> Callable[[str], bool]:
    return lambda ch: ch == c


def _in_range(lo: int, hi: int) -> Callable[[str], bool]:
    return lambda ch: lo <= ord(ch) <= hi


def _class_pred(items) -> Callable[[str], bool]:
    negate = False
    tests: list[Callable[[str], bool]] = []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            tests.append(_is_char(chr(av)))
        elif op is _c.RANGE:
            tests.append(_in_range(av[0], av[1]))
        elif op is _c.CATEGORY:
            if av not in _CATEGORIES:
                raise _Refused(f"the class {av}")
            tests.append(_CATEGORIES[av])
        else:
            raise _Refused(f"the class item {op}")
    if negate:
        return lambda ch: not any(t(ch) for t in tests)
    return lambda ch: any(t(ch) for t in tests)


class _Builder:
    def __init__(self) -> None:
        self.states: list = []

    def _new(self, state) -> int:
        if len(self.states) >= MAX_STATES:
            raise _TooBig
        self.states.append(state)
        return len(self.states) - 1

    def build(self, tree) -> _NFA:
        match = self._new(("match",))
        start = self._seq(list(tree), match)
        return _NFA(self.states, start)

    # each builder takes the state to continue with and returns the entry state
    def _seq(self, items, nxt: int) -> int:
        for op, av in reversed(items):
            nxt = self._item(op, av, nxt)
        return nxt

    def _char(self, pred, nxt: int) -> int:
        return self._new(["char", pred, nxt])

    def _item(self, op, av, nxt: int) -> int:
        if op is _c.LITERAL:
            return self._char(lambda ch, c=chr(av): ch == c, nxt)
        if op is _c.NOT_LITERAL:
            return self._char(lambda ch, c=chr(av): ch != c, nxt)
        if op is _c.ANY:
            return self._char(lambda ch: ch != "\n", nxt)
        if op is _c.IN:
            return self._char(_class_pred(av), nxt)
        if op is _c.CATEGORY:
            return self._char(_class_pred([(op, av)]), nxt)
        if op is _c.AT:
            return self._new(("assert", av, nxt))
        if op is _c.SUBPATTERN:
            return self._seq(list(av[3]), nxt)
        if op is _c.BRANCH:
            entries = [self._seq(list(alt), nxt) for alt in av[1]]
            entry = entries[-1]
            for e in reversed(entries[:-1]):
                entry = self._new(("split", e, entry))
            return entry
        if op in _REPEATS:
            lo, hi, body = av
            body = list(body)
            if hi == _c.MAXREPEAT:  # body* after lo copies
                loop = self._new(["split", -1, nxt])
                inner = self._seq(body, loop)
                self.states[loop] = ("split", inner, nxt)
                tail = loop
            else:
                tail = nxt
                for _ in range(hi - lo):  # optional copies, innermost first
                    inner = self._seq(body, tail)  # (?:x(?:x)?)?: each copy may stop
                    tail = self._new(("split", inner, nxt))
            for _ in range(lo):
                tail = self._seq(body, tail)
            return tail
        raise _Refused(f"the construct {op}")
