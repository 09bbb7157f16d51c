"""The format contract stays grouped by the engine that reads it: each facet of ``FormatSpec``
holds at most 12 names (dataclass fields + public methods and properties), every format
package fills its facets with facet objects, and a codec holds no switches of its own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from h3quant.formats import registry
from h3quant.formats.codec import Codec
from h3quant.formats.spec import (
    EncodingFacet,
    FormatSpec,
    RelayoutFacet,
    RuntimeFacet,
    StorageFacet,
    VerifyFacet,
)

LIMIT = 12
FACETS = {"storage": StorageFacet, "encoding": EncodingFacet, "relayout": RelayoutFacet,
          "runtime": RuntimeFacet, "verify": VerifyFacet}


def names(cls) -> set[str]:
    """Dataclass fields plus public methods and properties (inherited ones included)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    members = {n for n, v in inspect.getmembers(cls)
               if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return fields | members


def test_names_counts_fields_methods_and_properties():
    @dataclasses.dataclass(frozen=True)
    class Probe:
        a: int = 0
        _hidden: int = 0

        @property
        def b(self) -> int:
            return 1

        def c(self) -> int:
            return 2

        def _d(self) -> int:
            return 3

    assert names(Probe) == {"a", "_hidden", "b", "c"}


@pytest.mark.parametrize("facet", sorted(FACETS))
def test_facet_stays_small(facet):
    found = names(FACETS[facet])
    assert len(found) <= LIMIT, (f"spec.{facet} has {len(found)} names (at most {LIMIT}): "
                                 f"{sorted(found)}; split the facet instead of growing it")


def test_format_spec_holds_identity_and_the_facets():
    fields = {f.name: f for f in dataclasses.fields(FormatSpec)}
    facets = {n for n, f in fields.items() if f.type in {c.__name__ for c in FACETS.values()}}
    assert facets == set(FACETS)
    identity = set(fields) - facets
    assert identity == {"name", "description", "quantized", "comfy", "layout", "canonical",
                        "alias_of"}, sorted(identity)


@pytest.mark.parametrize("spec", registry.specs(), ids=lambda s: s.name)
def test_every_format_fills_its_facets_with_facet_objects(spec):
    for facet, cls in FACETS.items():
        assert type(getattr(spec, facet)) is cls, (spec.name, facet)


def test_codec_holds_no_switches():
    """Every switch about a format's tensor work is in the spec's facets, not on the codec."""
    for codec in {type(registry.get(s.name)) for s in registry.specs() if registry.get(s.name)}:
        data = {n for n, v in vars(codec).items() if not n.startswith("_") and not callable(v)
                and not isinstance(v, (property, staticmethod, classmethod))}
        assert not data, (codec.__name__, sorted(data))
    assert {n for n, v in vars(Codec).items() if not n.startswith("_") and not callable(v)} == set()
