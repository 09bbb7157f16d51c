"""The format contract stays grouped by the engine that reads it: ``FormatSpec`` holds its
identity and its facets only (no header-rule methods of its own), each facet holds at most 12
names (dataclass fields + public methods and properties), every format package fills its
facets with facet objects, each method facet is bound to its own spec, and a codec holds no
switches of its own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from h3quant.formats import registry
from h3quant.formats.codec import Codec
from h3quant.formats.spec import (
    EncodingFacet,
    FormatSpec,
    PlanningFacet,
    ReadingFacet,
    RelayoutFacet,
    RulesFacet,
    RuntimeFacet,
    StorageFacet,
    VerifyFacet,
)

LIMIT = 12
DATA_FACETS = {"storage": StorageFacet, "encoding": EncodingFacet, "relayout": RelayoutFacet,
               "runtime": RuntimeFacet, "verify": VerifyFacet}
# facets of methods a format overrides by subclassing the facet
METHOD_FACETS = {"reading": ReadingFacet, "planning": PlanningFacet, "rules": RulesFacet}
FACETS = {**DATA_FACETS, **METHOD_FACETS}
IDENTITY = {"name", "description", "quantized", "comfy", "layout", "canonical", "alias_of"}


def names(cls) -> set[str]:
    """Dataclass fields plus public methods and properties (inherited ones included)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
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


@pytest.mark.parametrize("spec", registry.specs(), ids=lambda s: s.name)
def test_a_format_s_method_facets_stay_small(spec):
    """A format's own facet subclass adds no names beyond the limit either."""
    for facet in METHOD_FACETS:
        found = names(type(getattr(spec, facet)))
        assert len(found) <= LIMIT, (spec.name, facet, sorted(found))


def test_format_spec_holds_identity_and_the_facets():
    fields = {f.name: f for f in dataclasses.fields(FormatSpec)}
    facets = {n for n, f in fields.items() if f.type in {c.__name__ for c in FACETS.values()}}
    assert facets == set(FACETS)
    identity = set(fields) - facets
    assert identity == IDENTITY, sorted(identity)
    # no header-rule methods left on the spec itself: identity, facets, the ``format`` property
    assert names(FormatSpec) == IDENTITY | set(FACETS) | {"format"}, sorted(
        names(FormatSpec) - IDENTITY - set(FACETS))


@pytest.mark.parametrize("spec", registry.specs(), ids=lambda s: s.name)
def test_every_format_fills_its_facets_with_facet_objects(spec):
    for facet, cls in DATA_FACETS.items():
        assert type(getattr(spec, facet)) is cls, (spec.name, facet)
    for facet, cls in METHOD_FACETS.items():
        assert isinstance(getattr(spec, facet), cls), (spec.name, facet)


def test_each_spec_binds_its_own_method_facets():
    """A facet object handed to two specs reads each spec's own data (``self.spec``)."""
    shared = ReadingFacet()
    a = FormatSpec(name="fmt_a", description="", reading=shared)
    b = FormatSpec(name="fmt_b", description="", reading=shared,
                   storage=StorageFacet(packed=True))
    assert (a.reading.describe(None), b.reading.describe(None)) == ("fmt_a", "fmt_b")
    assert (a.reading.logical_k(8, None), b.reading.logical_k(8, None)) == (8, 16)
    for spec in registry.specs():
        for facet in METHOD_FACETS:
            assert getattr(spec, facet).spec is spec, (spec.name, facet)


def test_codec_holds_no_switches():
    """Every switch about a format's tensor work is in the spec's facets, not on the codec."""
    for codec in {type(registry.get(s.name)) for s in registry.specs() if registry.get(s.name)}:
        data = {n for n, v in vars(codec).items() if not n.startswith("_") and not callable(v)
                and not isinstance(v, (property, staticmethod, classmethod))}
        assert not data, (codec.__name__, sorted(data))
    assert {n for n, v in vars(Codec).items() if not n.startswith("_") and not callable(v)} == set()
