"""What an output constraint must pass, beyond compiling, before a request with it is admitted.

llguidance compiles a grammar whose rules can never end, such as a JSON schema whose required
property (or first array item) is the schema itself through a `$ref`: no finite JSON value
matches it. Its parser predicts such rules all the same, so the first tokens are allowed and
decoding fails a few tokens in, when the forced continuation grows without bound ("Too many
items"). Two checks turn that, and every grammar whose first step already fails, into a 400:

* `unproductive_schema` and `unproductive_lark`: the classic productivity analysis of a grammar
  (a rule is productive when some alternative is made only of productive parts), over a JSON
  schema's keywords (`$ref` cycles resolved by a worklist) or a Lark grammar's rules. Unknown
  keywords, references and syntax are taken as productive (a Lark grammar this reader does not
  follow is not judged), so the checks refuse only grammars that have no finite output.
* `probe_matcher`: a dry run of a copy of the compiled matcher through its first step: the first
  token mask (an error, or no token allowed in a state that does not accept, is a grammar that
  produces nothing) and the tokens the grammar forces from there (a Lark rule such as
  `a: "x" a` forces an endless run and fails there, as generation would).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from llguidance import LLMatcher

_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SINGLE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")


def _resolve(root: Any, ref: Any) -> Any:
    """The subschema a local `$ref` ("#" or a "#/..." JSON pointer) names; None when it is not
    local or not found (then the reference is taken as productive)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def _typed(node: dict, key: str, kind: type) -> Any:
    """node[key] if it is a `kind` (dict or list), else an empty one (llguidance judges the rest)."""
    value = node.get(key)
    return value if isinstance(value, kind) else kind()


def _children(node: dict, root: Any) -> list[Any]:
    out: list[Any] = []
    for key in _LISTS:
        if isinstance(node.get(key), list):
            out += node[key]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out += node[key].values()
    for key in _SINGLE:
        if key in node:
            out += node[key] if isinstance(node[key], list) else [node[key]]
    if "$ref" in node:
        out.append(_resolve(root, node["$ref"]))
    return [c for c in out if isinstance(c, dict)]


class _Productivity:
    """Which subschemas of one schema have a finite instance (see the module docstring)."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.productive: set[int] = set()

    def ok(self, node: Any) -> bool:
        if isinstance(node, bool):
            return node
        return not isinstance(node, dict) or id(node) in self.productive

    def _ref_ok(self, node: dict) -> bool:
        if "$ref" not in node:
            return True
        target = _resolve(self.root, node["$ref"])
        return target is None or self.ok(target)

    def _object_ok(self, node: dict) -> bool:
        properties = _typed(node, "properties", dict)
        extra = node.get("additionalProperties", True)
        for name in _typed(node, "required", list):
            if name in properties:
                if not self.ok(properties[name]):
                    return False
            elif not node.get("patternProperties") and not self.ok(extra):
                return False
        return True

    def _array_ok(self, node: dict) -> bool:
        need = node.get("minItems", 0)
        prefix = _typed(node, "prefixItems", list)
        if not isinstance(need, int) or isinstance(need, bool) or need <= 0:
            return True
        if not all(self.ok(item) for item in prefix[:need]):
            return False
        return need <= len(prefix) or self.ok(node.get("items", True))

    def rule(self, node: dict) -> bool:
        """Whether `node` has an instance, given the subschemas known productive so far."""
        if not self._ref_ok(node):
            return False
        if isinstance(node.get("allOf"), list) and not all(self.ok(s) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and not any(self.ok(s) for s in node[key]):
                return False
        if "const" in node or node.get("enum"):
            return True  # the instance is given; whether it fits the rest is llguidance's check
        kinds = node.get("type")
        if kinds is None:
            return True  # any type: a string or a number is an instance
        kinds = set(kinds) if isinstance(kinds, list) else {kinds}
        if kinds - {"object", "array"}:
            return True  # a primitive type (or one llguidance refuses by name)
        return ("object" in kinds and self._object_ok(node)) or ("array" in kinds and self._array_ok(node))

    def solve(self) -> None:
        nodes: dict[int, dict] = {}
        parents: dict[int, list[dict]] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            if id(node) in nodes:
                continue
            nodes[id(node)] = node
            for child in _children(node, self.root):
                parents.setdefault(id(child), []).append(node)
                stack.append(child)
        work = list(nodes.values())
        while work:
            node = work.pop()
            if id(node) not in self.productive and self.rule(node):
                self.productive.add(id(node))
                work += parents.get(id(node), [])


def unproductive(kind: str, source: Any) -> str | None:
    """Why a constraint ("json" schema, "lark" grammar; a regular expression always has finite
    matches) has no finite output, or None."""
    if kind == "json":
        return unproductive_schema(source)
    return unproductive_lark(source) if kind == "lark" else None


def unproductive_schema(schema: dict) -> str | None:
    """Why no finite JSON value matches `schema` (naming the `$ref` that never ends), or None."""
    check = _Productivity(schema)
    check.solve()
    if check.ok(schema):
        return None
    stack, seen = [schema], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        target = _resolve(schema, node.get("$ref"))
        if target is not None and not check.ok(target):
            return (f"the schema has no finite instance: the $ref {node['$ref']!r} requires itself again at every "
                    f"level (make the recursive property optional, or allow an empty array)")
        stack += _children(node, schema)
    return "the schema has no finite instance"


# ---- Lark -------------------------------------------------------------------------------------
_DEFINITION = re.compile(r"[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:(?!:)")
_TOKEN = re.compile(r"""\s*(?:(?P<lit>"(?:[^"\\]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[a-z]*|<[^>\n]*>)
                        |(?P<alias>->\s*[A-Za-z_][A-Za-z_0-9]*)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)
                        |(?P<number>\d+)|(?P<directive>%[a-z]+)|(?P<punct>\.\.|[|()\[\]?*+~{},]))""", re.X)
Expr = tuple  # ("lit",) | ("ref", name) | ("opt",) | ("rep", expr) | ("seq", [expr]) | ("alt", [expr])


class _Unreadable(Exception):
    """Syntax this reader does not follow: the grammar is not judged."""


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body.rstrip()):
        m = _TOKEN.match(body, pos)
        if m is None or m.lastgroup is None:
            raise _Unreadable(body[pos:pos + 20])
        kind, pos = m.lastgroup, m.end()
        if kind == "directive":  # %json {...} and the like: one literal, braces matched past strings
            start = body.index("{", pos) if "{" in body[pos:pos + 40] else -1
            if start < 0:
                raise _Unreadable(m.group(kind))
            depth, i, in_string = 0, start, False
            while i < len(body):
                c = body[i]
                if in_string:
                    i += 1 if c == "\\" else 0
                    in_string = c != '"'
                elif c == '"':
                    in_string = True
                elif c in "{}":
                    depth += 1 if c == "{" else -1
                    if depth == 0:
                        break
                i += 1
            kind, pos = "lit", i + 1
        if kind != "alias":
            out.append((kind, m.group(kind) if kind != "lit" else ""))
    return out


class _LarkParser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) and self.tokens[self.i][0] == "punct" else None

    def take(self, want: str) -> None:
        if self.peek() != want:
            raise _Unreadable(want)
        self.i += 1

    def alternatives(self) -> Expr:
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self) -> Expr:
        items = []
        while self.i < len(self.tokens) and self.peek() not in ("|", ")", "]"):
            items.append(self.item())
        return ("seq", items)

    def item(self) -> Expr:
        kind, text = self.tokens[self.i]
        self.i += 1
        if kind == "lit":
            atom: Expr = ("lit",)
        elif kind == "name":
            atom = ("ref", text)
        elif text == "(":
            atom = self.alternatives()
            self.take(")")
        elif text == "[":
            self.alternatives()
            self.take("]")
            atom = ("opt",)
        else:
            raise _Unreadable(text)
        op = self.peek()
        if op in ("?", "*"):
            self.i += 1
            return ("opt",)
        if op == "+":
            self.i += 1
            return ("rep", atom)
        if op in ("~", "{"):  # x~n, x~n..m, x{n}, x{n,m}: optional when n is 0
            self.i += 1
            least = self.number()
            if self.peek() in ("..", ","):
                self.i += 1
                if self.peek() != "}":
                    self.number()
            if op == "{":
                self.take("}")
            return ("opt",) if least == 0 else ("rep", atom)
        return atom

    def number(self) -> int:
        if self.i >= len(self.tokens) or self.tokens[self.i][0] != "number":
            raise _Unreadable("a repetition count")
        self.i += 1
        return int(self.tokens[self.i - 1][1])


def _lark_rules(text: str) -> dict[str, Expr]:
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in re.sub(r"(?m)^\s*//.*$", "", text).splitlines():
        if line.lstrip().startswith("%") and not line[:1].isspace():
            current = None  # %import, %ignore, %llguidance: names it brings are taken as productive
            continue
        m = _DEFINITION.match(line)
        if m is not None and not line[:1].isspace():
            current = bodies.setdefault(m.group(1), [])
            current.append("|" if current else "")
            line = line[m.end():]
        elif current is None:
            if line.strip():
                raise _Unreadable(line)
            continue
        current.append(line)
    rules = {}
    for name, lines in bodies.items():
        parser = _LarkParser(_tokens("\n".join(lines).lstrip("|")))
        rules[name] = parser.alternatives()
        if parser.i != len(parser.tokens):
            raise _Unreadable(name)
    return rules


def unproductive_lark(text: str) -> str | None:
    """Why a Lark grammar has no finite output (naming the rules that never end), or None; None
    too for a grammar this reader does not follow."""
    try:
        rules = _lark_rules(text)
    except (_Unreadable, ValueError):
        return None
    productive: set[str] = set()

    def ok(expr: Expr) -> bool:
        kind = expr[0]
        if kind == "ref":
            return expr[1] in productive or expr[1] not in rules
        if kind == "rep":
            return ok(expr[1])
        if kind in ("seq", "alt"):
            return (all if kind == "seq" else any)(ok(e) for e in expr[1])
        return True

    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in productive and ok(expr):
                productive.add(name)
                changed = True
    if "start" not in rules or "start" in productive:
        return None
    never = ", ".join(sorted(n for n in rules if n not in productive))
    return f"the grammar has no finite output: its rules {never} never end"


def probe_matcher(compiled: LLMatcher) -> str | None:
    """Why a copy of `compiled` fails its first step (see the module docstring), or None."""
    matcher = compiled.deep_copy()
    mask = matcher.compute_bitmask()
    if matcher.is_error() or (not any(mask) and not matcher.is_accepting()):
        return f"it allows no output at all ({_first_line(matcher.get_error())})"
    forced = matcher.compute_ff_tokens()
    if matcher.is_error() or (forced and not matcher.consume_tokens(forced)):
        return f"its forced output never ends ({_first_line(matcher.get_error())})"
    return None


def _first_line(message: str | None) -> str:
    return (message or "no token is allowed").strip().splitlines()[0]
