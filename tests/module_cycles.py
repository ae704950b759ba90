#!/usr/bin/env python3
"""Module-cycle gate: layers point one way, so no module depends on itself through others.

For each crate's bdev_qcow2/*/src, builds the graph of its library modules: a -> b when a
names b (`use crate::…`/`super::…`/`self::…`, a `use` of a child module, a `crate::`,
`super::` or `self::` path in code; a path through a `pub use` leads to where it re-exports
from). A module naming its own descendants is no edge; comments, strings, `#[cfg(test)]`
modules and src/bin/ (separate crates) are left out. Prints each strongly connected
component of more than one module and exits 1, else one OK line per crate.
`--self-test` checks the analysis on small synthetic crates.
"""
import re
import sys
import tempfile
from pathlib import Path

LEX = re.compile(r'//[^\n]*|/\*|(?<!\w)b?r(#*)".*?"\1|b?"(?:\\.|[^"\\])*"'
                 r"|'(?:\\(?:'|[^']+)|[^\\'])'", re.S)
CFG_TEST = re.compile(r'#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]\s*(?:#\s*\[[^\]]*\]\s*)*'
                      r'(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])')
USE = re.compile(r'(^|[;{}\]])(\s*(pub(?:\s*\([^)]*\))?\s+)?use\s+([^;]*);)', re.M)
INLINE_MOD = re.compile(r'\bmod\s+(\w+)\s*\{')
CODE_PATH = re.compile(r'(?<![\w:$])(?:crate|self|super)(?:\s*::\s*\w+)+')
PUB_IN = re.compile(r'\bpub\s*\(\s*in\s+[^)]*\)')


def strip(src):
    """The source without comments, string and char literals (lifetimes kept)."""
    out, pos = [], 0
    while m := LEX.search(src, pos):
        out.append(src[pos:m.start()])
        pos = m.end()
        if m.group(0) == '/*':  # block comments nest
            depth = 1
            while depth and pos < len(src):
                step = src[pos:pos + 2]
                depth += (step == '/*') - (step == '*/')
                pos += 2 if step in ('/*', '*/') else 1
        elif not m.group(0).startswith('//'):
            out.append("' '" if m.group(0).startswith("'") else '""')
    return ''.join(out) + src[pos:]


def closing(text, open_at):
    """Index just past the brace matching the one at `open_at`."""
    depth = 0
    for j in range(open_at, len(text)):
        depth += {'{': 1, '}': -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def use_paths(tree):
    """Expands a use tree (`a::{b::{self, C}, d as e}`) into (segments, name) pairs."""
    toks, out = re.findall(r'\w+|::|[{},*]', tree), []

    def walk(i, prefix):
        path = list(prefix)
        while i < len(toks):
            t, i = toks[i], i + 1
            if t == '{':
                while i < len(toks) and toks[i] != '}':
                    i = walk(i, path)
                    i += i < len(toks) and toks[i] == ','
                return i + 1
            if t == '*':
                out.append((path, '*'))
                return i
            if not (t == 'self' and path and len(path) == len(prefix)):
                path.append(t)  # `{self}` names the prefix itself
            if i < len(toks) and toks[i] == '::':
                i += 1
                continue
            as_name = i + 1 < len(toks) and toks[i] == 'as'
            out.append((path, toks[i + 1] if as_name else path[-1]))
            return i + 2 if as_name else i
        return i
    walk(0, [])
    return out


def analyse(src_dir):
    """{module: modules it names}, modules being tuples of names (the root is `()`)."""
    files = {}
    for f in sorted(Path(src_dir).rglob('*.rs')):
        rel = f.relative_to(src_dir).with_suffix('').parts
        if rel[0] != 'bin':
            mod = () if rel in (('lib',), ('main',)) else rel[:-1] if rel[-1] == 'mod' else rel
            files[mod] = f.read_text(encoding='utf-8', errors='replace')
    excluded, inline, refs, exports = set(), set(), [], {}
    for mod, src in files.items():
        text = PUB_IN.sub('pub', strip(src))
        while m := CFG_TEST.search(text):
            end = closing(text, m.end() - 1) if m.group(2) == '{' else m.end()
            if m.group(2) == ';':
                excluded.add(mod + (m.group(1),))
            text = text[:m.start()] + ' ' * (end - m.start()) + text[end:]
        spans = [(m.start(), closing(text, m.end() - 1), m.group(1))
                 for m in INLINE_MOD.finditer(text)]
        inline.update(mod + (name,) for _, _, name in spans)

        def where(pos):
            return mod + tuple(name for s, e, name in spans if s <= pos < e)
        for m in USE.finditer(text):
            at = where(m.start(2))
            for segs, name in use_paths(m.group(4)):
                refs.append((at, segs, True))
                if m.group(3) and name != '*':
                    exports[at + (name,)] = (at, segs)
        text = USE.sub(lambda m: m.group(1) + ' ' * len(m.group(2)), text)
        for m in CODE_PATH.finditer(text):
            refs.append((where(m.start()), re.split(r'\s*::\s*', m.group(0)), False))
    mods = {m for m in {()} | set(files) | inline
            if not any(m[:len(x)] == x for x in excluded)}

    def resolve(at, segs, in_use, depth=0):
        if segs[0] == 'crate':
            path, segs = [], segs[1:]
        elif segs[0] in ('self', 'super') or (in_use and at + (segs[0],) in mods):
            path = list(at)
            while segs and segs[0] in ('self', 'super'):
                path, segs = (path[:-1] if segs[0] == 'super' else path), segs[1:]
        else:
            return None  # another crate
        path += segs
        k = max(k for k in range(len(path) + 1) if tuple(path[:k]) in mods)
        target = tuple(path[:k])
        if k < len(path) and target + (path[k],) in exports and depth < 8:
            src, sub = exports[target + (path[k],)]
            return resolve(src, sub + path[k + 1:], True, depth + 1) or target
        return target
    edges = {m: set() for m in mods}
    for at, segs, in_use in refs:
        to = resolve(at, segs, in_use) if at in mods else None
        if to is not None and to[:len(at)] != at:
            edges[at].add(to)
    return edges


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, out = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            at = stack.index(v)
            if len(stack) - at > 1:
                out.append(sorted('::'.join(m) or 'crate' for m in stack[at:]))
            del stack[at:]
    sys.setrecursionlimit(max(1000, 4 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


SELF_TESTS = {  # name: ({file: source}, cycles expected[, every module expected])
    'cycle': ({'lib': 'mod a; mod b;', 'a': 'use crate::{b::{self, X}};',
               'b/mod': 'fn f() { crate::a::g(); }'}, [['a', 'b']]),
    'dag': ({'lib': 'mod a; mod b; mod c;', 'a': 'use crate::b::X; use super::c;',
             'b/mod': 'use crate::c::*;', 'c': '// use crate::a;\nconst S: &str = "crate::a";'}, []),
    'own child': ({'lib': 'mod a;', 'a/mod': 'mod kid; pub use kid::K; use self::kid::J;',
                   'a/kid': 'use super::super::a::Z; use super::{Y, W as V};'}, []),
    'cfg(test)': ({'lib': 'mod a; mod b;', 'b': 'use crate::a::f;',
                   'a': 'pub fn f() {}\n#[cfg(test)]\n#[allow(x)]\nmod tests { use crate::b::*;'
                        ' fn t() { crate::b::g() } }\n#[cfg(test)]\nmod more;',
                   'a/more': 'use crate::b::H;'}, [], ['a', 'b', 'crate']),
    're-export': ({'lib': 'mod a; mod b; pub use b::B;', 'a': "use crate::B; fn f<'a>() { '\\''; 'x'; }",
                   'b': 'use crate::a::f; /* crate::z /* nested */ crate::y */'}, [['a', 'b']]),
    'inline mod': ({'lib': 'mod a; mod b;', 'a': 'pub mod inner { use crate::b::X; }',
                    'b': 'use crate::a::inner::Y;'}, [['a::inner', 'b']]),
}


def self_test():
    failed = 0
    for case, (sources, want, *modules) in SELF_TESTS.items():
        with tempfile.TemporaryDirectory() as d:
            for rel, text in sources.items():
                (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(d) / (rel + '.rs')).write_text(text)
            edges = analyse(d)
        got = cycles(edges)
        if modules and sorted('::'.join(m) or 'crate' for m in edges) != modules[0]:
            got, want = sorted(edges), modules[0]
        failed += got != want
        print(f"self-test {case}: {'ok' if got == want else f'FAILED: {got}, want {want}'}")
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ['--self-test']:
        return self_test()
    status = 0
    for src in sorted(Path(__file__).resolve().parent.parent.glob('bdev_qcow2/*/src')):
        edges = analyse(src)
        found = cycles(edges)
        for c in found:
            print(f"{src.parent.name}: cycle of {len(c)} modules: {', '.join(c)}")
        if not found:
            print(f'{src.parent.name}: OK, {len(edges)} modules, no cycle')
        status |= bool(found)
    return status


if __name__ == '__main__':
    sys.exit(main())
