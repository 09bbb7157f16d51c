"""``convert --calibration``: each layer's statistics handed to its codec, and what they gave.

The statistics file (``h3quant capture``) must have been measured on the very checkpoint being
converted (its header checksum); otherwise the run is refused before any work. Per layer:

* a layer the file has no statistics for, or whose target format has no calibrated encoder, is
  rounded to nearest (noted in the report);
* a layer that saw fewer input rows than its input width K is rounded to nearest with a warning:
  its Hessian is singular, and error feedback steered by the damping alone can be worse than
  rounding (a measured effect, not a precaution);
* otherwise the codec chooses its scales as always and its codes by error feedback
  (``calibration.gptq``). The report gives the predicted gain and the measured output SQNR
  ``10 log10(tr(W H W^T) / tr(E H E^T))`` on the sampled rows, over the calibration inputs'
  ``H`` and, with ``--calibration-heldout``, over held-out inputs' ``H`` (float activations).
"""

from __future__ import annotations

from h3quant.errors import FormatError


class Divided:
    """Statistics whose layers' inputs are divided by smoothing factors (``s`` by layer name):
    ``layer`` gives ``LayerStats.divided``; everything else is the file's."""

    def __init__(self, stats, factors: dict):
        self._stats, self._factors = stats, factors
        self._made: dict = {}

    def __getattr__(self, name):
        return getattr(self._stats, name)

    def layer(self, name: str):
        st = self._stats.layer(name)
        s = self._factors.get(name)
        if st is None or s is None or st.k != s.numel():
            return st
        if name not in self._made:
            self._made[name] = st.divided(s)
        return self._made[name]


class Calibration:
    """The open statistics of one conversion (and the held-out ones, when given)."""

    def __init__(self, stats, src, log=None, *, heldout=None, smoothed=None, aware=False):
        """``stats``: the statistics file of checkpoint ``src`` (``heldout``: those of other
        inputs, reported only); both are refused for another checkpoint. ``smoothed``: layer
        name -> smoothing factors folded into the input (``convert.smoothing``): both files'
        statistics are seen divided by them. ``aware``: error feedback models the runtime's
        rounding of each layer's inputs (``calibration.aware``) where the format rounds them and
        the file holds sampled rows."""
        from h3quant.calibration.fingerprint import checkpoint_fingerprint
        from h3quant.calibration.stats import Statistics

        self.log = log or (lambda msg: None)
        self.aware = aware
        fp = checkpoint_fingerprint(src)
        self.stats = Statistics(stats)
        self.heldout = None
        try:
            self.stats.check_checkpoint(fp)
            if heldout:
                self.heldout = Statistics(heldout)
                self.heldout.check_checkpoint(fp)
        except BaseException:
            self.close()
            raise
        if smoothed:
            self.stats = Divided(self.stats, smoothed)
            if self.heldout is not None:
                self.heldout = Divided(self.heldout, smoothed)
        meta = self.stats.meta
        rows = sorted(set(meta["rows"].values()))
        self.log(f"calibration: {len(self.stats.layers)} layers' statistics from "
                 f"{len(meta['inputs'])} input(s), {rows[0] if rows else 0:,} rows per layer, "
                 f"forward: {meta.get('forward', 'float')}")

    def smoothed_by(self, factors: dict) -> "Calibration":
        """This calibration seen through smoothing ``factors`` (layer name -> ``s``): the
        statistics divided as ``convert --smooth auto`` divides them, held-out ones left out.
        It shares the open files: close this one, never the view."""
        import copy

        view = copy.copy(self)
        view.stats = Divided(self.stats, factors) if factors else self.stats
        view.heldout = None
        return view

    def for_layer(self, name: str, k: int, codec, marker) -> tuple[object, dict]:
        """(layer ``name``'s ``LayerStats`` or None to round to nearest, its report entry);
        ``k``: the weight's input width, which the statistics must have."""
        info: dict = {}
        st = self.stats.layer(name)
        if st is None:
            if codec.spec.encoding.write_refusal:
                raise FormatError(f"the statistics have no entry for this layer; {codec.spec.name} is "
                                  "written from statistics only", tensor=name)
            info["note"] = "no statistics for this layer: rounded to nearest"
            return None, info
        if st.k != k:
            raise FormatError(f"the statistics hold K={st.k} for this layer, the weight has "
                              f"K={k}", tensor=name)
        info["rows"] = st.rows
        if not codec.spec.encoding.calibrates:
            info["note"] = f"{codec.spec.name} has no calibrated encoder: rounded to nearest"
            return None, info
        if st.rows < st.k and codec.spec.encoding.write_refusal:  # written from statistics only
            info["note"] = (f"only {st.rows} rows for K={st.k}: calibrated anyway ({codec.spec.name} "
                            "is written from statistics only)")
            self.log(f"warning: {name}: {info['note']}")
        elif st.rows < st.k:
            info["note"] = (f"only {st.rows} rows for K={st.k} (a singular Hessian): rounded to "
                            "nearest")
            self.log(f"warning: {name}: {info['note']}")
            return None, info
        convrot = codec.spec.reading.uses_convrot(marker)
        g = int((marker or {}).get("convrot_groupsize", 256))
        info["basis"] = f"convrot g={g}" if convrot else "plain"
        info["predicted_gain_db"] = round(st.predicted_gain_db(convrot, g), 2)
        self.log(f"calibrating {name}: K={st.k}, {st.rows:,} rows, predicted gain "
                 f"{info['predicted_gain_db']:+.1f} dB")
        if self.aware:
            st, info["activation_aware"] = self._aware(st, codec, marker)
        return st, info

    @staticmethod
    def _aware(st, codec, marker):
        """(the statistics error feedback uses, what the report says about activation-aware
        feedback): the runtime's input rounding attached where it applies."""
        from h3quant.calibration.aware import input_rounding

        rounding = input_rounding(codec, marker)
        if rounding is None:
            return st, "off: the runtime keeps this format's activations in float"
        if not st.has_rows:
            return st, "off: the statistics hold no sampled rows (version 1)"
        aware = st.rounded_by(rounding)  # takes over the loaded Hessian
        st.release()
        return aware, "on"

    def output_sqnr(self, lp, ref, w_hat) -> dict:
        """Output SQNR (dB) of the sampled rows over the calibration (and held-out) inputs."""
        from h3quant.calibration.gptq import output_sqnr_db

        out = {}
        for name, stats in (("calibration", self.stats), ("heldout", self.heldout)):
            st = stats.layer(lp.name) if stats is not None else None
            if st is not None and st.k == ref.shape[1]:
                out[name] = round(output_sqnr_db(ref, w_hat, st.hessian()), 3)
                if stats is self.heldout:
                    st.release()
        return out

    def close(self) -> None:
        for s in (self.stats, self.heldout):
            if s is not None:
                s.close()


__all__ = ["Calibration", "Divided"]
