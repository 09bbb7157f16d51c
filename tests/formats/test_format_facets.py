"""The format contract stays grouped by the engine that reads it: ``FormatSpec`` holds its
identity and its facets only (no header-rule methods of its own), each facet holds at most 12
names (dataclass fields + public methods and properties), every format package fills its
facets with facet objects, each method facet is bound to its own spec, and no format subclasses
``FormatSpec``. The codec likewise: ``Codec`` holds its spec and its facets only (no method of
its own), every codec facet (and every format's subclass of one) holds at most 12 names, no
format subclasses ``Codec``, each codec facet is bound to its codec's spec, and a codec holds no
switches of its own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from h3quant.formats import registry
from h3quant.formats.codec import Checks, Codec, Decoder, Emulator, Encoder, Grid
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
# the codec's facets of tensor work, by the engine that calls them
CODEC_FACETS = {"decoder": Decoder, "encoder": Encoder, "grid": Grid, "emulator": Emulator,
                "checks": Checks}


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


def test_no_format_subclasses_format_spec():
    """A format's own data goes into a facet (fp8's codes: its planning facet), not into a
    ``FormatSpec`` subclass."""
    for spec in registry.specs():
        assert type(spec) is FormatSpec, (spec.name, type(spec).__name__)


def _codecs():
    return [c for c in (registry.get(s.name) for s in registry.specs()) if c is not None]


@pytest.mark.parametrize("facet", sorted(CODEC_FACETS))
def test_codec_facet_stays_small(facet):
    found = names(CODEC_FACETS[facet])
    assert len(found) <= LIMIT, (f"codec.{facet} has {len(found)} names (at most {LIMIT}): "
                                 f"{sorted(found)}; split the facet instead of growing it")


@pytest.mark.parametrize("codec", _codecs(), ids=lambda c: c.spec.name)
def test_a_format_s_codec_facets_stay_small(codec):
    """A format's own codec facet subclass adds no names beyond the limit either."""
    for facet in CODEC_FACETS:
        found = names(type(getattr(codec, facet)))
        assert len(found) <= LIMIT, (codec.spec.name, facet, sorted(found))


def test_codec_holds_its_spec_and_the_facets_only():
    """No method returns to ``Codec`` itself, and no format subclasses it: a format's tensor
    work goes to the facet of the engine that calls it."""
    assert names(Codec) == set(), sorted(names(Codec))
    assert {n for n in vars(Codec) if not n.startswith("_")} <= set(CODEC_FACETS), sorted(vars(Codec))
    for codec in _codecs():
        assert type(codec) is Codec, (codec.spec.name, type(codec).__name__)
        assert set(vars(codec)) == {"spec"} | set(CODEC_FACETS), (codec.spec.name, sorted(vars(codec)))


@pytest.mark.parametrize("codec", _codecs(), ids=lambda c: c.spec.name)
def test_every_codec_fills_its_facets_with_facet_objects_bound_to_its_spec(codec):
    for facet, cls in CODEC_FACETS.items():
        obj = getattr(codec, facet)
        assert isinstance(obj, cls), (codec.spec.name, facet, type(obj).__name__)
        assert obj.spec is codec.spec, (codec.spec.name, facet)


def test_each_codec_binds_its_own_facets():
    """A facet object handed to two codecs reads each codec's own spec (``self.spec``)."""

    class Named(Grid):
        def grid_origin(self, q):
            return self.spec.name

    shared = Named()
    a = Codec(FormatSpec(name="fmt_a", description=""), grid=shared)
    b = Codec(FormatSpec(name="fmt_b", description=""), grid=shared)
    assert (a.grid.grid_origin(None), b.grid.grid_origin(None)) == ("fmt_a", "fmt_b")
    assert isinstance(a.encoder, Encoder) and a.encoder is not b.encoder  # defaults, each its own


def test_codec_holds_no_switches():
    """Every switch about a format's tensor work is in the spec's facets, not on the codec."""
    classes = {type(getattr(c, f)) for c in _codecs() for f in CODEC_FACETS}
    for cls in classes | set(CODEC_FACETS.values()):
        for klass in cls.__mro__[:-1]:  # the facet, its bases up to object
            data = {n for n, v in vars(klass).items() if not n.startswith("_") and not callable(v)
                    and not isinstance(v, (property, staticmethod, classmethod))}
            assert not data, (klass.__name__, sorted(data))
    assert {n for n, v in vars(Codec).items() if not n.startswith("_") and not callable(v)} == set()
