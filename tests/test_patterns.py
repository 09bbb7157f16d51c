"""User-written patterns run in bounded time: the automaton of ``h3quant.patterns`` agrees with
``re.search`` (checked here against ``re`` itself on many patterns and names), a catastrophic
pattern in ``--layer``, ``--include`` or a recipe is matched or refused in well under a second,
and constructs that cannot be bounded are usage errors naming the rule."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from hostile_util import h3q, tiny_base

from h3quant.errors import UsageError
from h3quant.patterns import _Builder, _p, compile_pattern

NAMES = ["blocks.0.attn.qkv_proj", "blocks.12.mlp.fc1", "token_refiner.blocks.1.mlp.fc2",
         "aab", "abab", "ababb", "xxy", "xy", "xxxxxy", "abc", "c", "ab b", "", "x", "a_1.",
         "zz9!", "blocks.3.attn.out_proj\n"]
PATTERNS = [r"blocks\.(0|1)\.", r"^blocks\.\d+\.attn\.", r"(a|b)*c$", r"x{2,4}y", r"x{0,3}$",
            r"^(?:ab|a)*b\b", r"[^.]+\.fc\d$", r"\Ablocks", r"mlp\Z", r"\bfc1", r"a+?b",
            r"(.*)(.*)attn", r"[a-c\d_]{2}\W", r"(x+x+)+y", r"(\w+\.)*fc[12]$", r"\Bb", r"\s",
            r"[^\d]", r"(?:(?:a|b)c?)+$", r"out_proj$"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_automaton_agrees_with_re(pattern):
    nfa = _Builder().build(_p.parse(pattern))
    rnd = random.Random(pattern)
    names = NAMES + ["".join(rnd.choice("abcxy._19 ") for _ in range(rnd.randrange(12)))
                     for _ in range(200)]
    for name in names:
        assert nfa.search(name) == (re.search(pattern, name) is not None), (pattern, name)


@pytest.mark.parametrize("pattern", [r"(.|.|.|.)*Z$", r"(x+x+)+y", r"(a|aa)*b", r".*" * 12 + "Z",
                                     r"(\w+\.)*\w+\.Z$"])
def test_catastrophic_patterns_are_matched_quickly(pattern):
    p = compile_pattern(pattern, "--layer")
    name = "attn.qkv_proj." * 8 + "x" * 60  # no b, y or Z: a backtracking engine explodes
    t0 = time.monotonic()
    for _ in range(50):
        assert p.search(name) is False
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("pattern,why", [(r"(a)\1", "backreference"), (r"(?=a)b", "lookahead"),
                                         (r"(?<!a)b", "lookahead"), (r"(?i)attn", "inline flags"),
                                         (r"(a)?(?(1)b|c)", "conditional"),
                                         (r"a*+", "possessive"), (r"(?>a*)b", "atomic"),
                                         ("x" * 70000, "limit"), (r"a{1000}b{1000}c{3000}(d|e)*",
                                                                  "states")])
def test_unboundable_patterns_are_refused_naming_the_rule(pattern, why):
    with pytest.raises(UsageError, match=why) as err:
        compile_pattern(pattern, "rule 7")
    assert "rule 7" in str(err.value)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("p") / "base.safetensors")


def test_catastrophic_layer_rule_ends_quickly_as_a_usage_error(base, tmp_path):
    t0 = time.monotonic()
    res = h3q("convert", base, tmp_path / "o.safetensors", "--layer", "(.|.|.|.)*Z$=bf16",
              "--dry-run", timeout=60)
    assert time.monotonic() - t0 < 60
    assert res.returncode == 2, res.stderr
    assert "(.|.|.|.)*Z$" in res.stderr and "rule 1" in res.stderr  # names no layer


def test_catastrophic_recipe_rule_and_include_end_quickly(base, tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"rules": [{"layer": r"(x+x+)+y", "format": "bf16"}]}))
    res = h3q("convert", base, tmp_path / "o.safetensors", "--recipe", recipe, "--dry-run",
              timeout=60)
    assert res.returncode == 2 and "(x+x+)+y" in res.stderr, res.stderr
    res = h3q("convert", base, tmp_path / "o.safetensors", "--include", r"(.|.|.|.)*Z$",
              "--dry-run", timeout=60)
    assert res.returncode in (0, 2) and "Traceback" not in res.stderr, res.stderr
    res = h3q("convert", base, tmp_path / "o.safetensors", "--layer", r"(a)\1=bf16",
              "--dry-run", timeout=60)
    assert res.returncode == 2 and "backreference" in res.stderr, res.stderr
