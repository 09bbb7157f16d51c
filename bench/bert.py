"""A BERT-style sentence encoder in plain torch, for bench/real_weights.py.

Everything a sentence-transformers BERT model needs, written here from its published structure
(no transformers, no tokenizers package): the uncased WordPiece tokenizer over the model's
``vocab.txt``, the post-LayerNorm encoder (embeddings, self-attention, GELU feed-forward) and
mean pooling over the real tokens. Every linear is a module in ``BertModel.linears`` so a bench
can replace it with a quantized one.

Each encoder layer's four linears play the roles of an H3 block's:

- ``attn.qkv``: query, key and value rows fused ``[q; k; v]`` (H3's ``attn.qkv_proj``);
- ``attn.out``: the attention output projection (``attn.out_proj``);
- ``ffn.fc1``: the intermediate (up) projection (``mlp.fc1``, which holds ``[gate; up]`` in H3);
- ``ffn.fc2``: the output (down) projection (``mlp.fc2``).

Unlike H3 (RMSNorm before each sublayer, SwiGLU), BERT normalizes after each residual and uses
GELU, so fc2's input comes out of a GELU rather than a product of two linears.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROLES = {"attn.qkv": "attn.qkv_proj", "attn.out": "attn.out_proj", "ffn.fc1": "mlp.fc1",
         "ffn.fc2": "mlp.fc2"}


# --- tokenizer ------------------------------------------------------------------------------

def _is_punct(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def basic_tokens(text: str, lower: bool = True) -> list[str]:
    """BERT's basic tokenizer: control characters dropped, lower case and accents stripped
    (uncased models), split on whitespace and around every punctuation character and CJK
    ideograph."""
    out: list[str] = []
    if lower:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    word: list[str] = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch.isspace():
            if word:
                out.append("".join(word))
                word = []
        elif cat.startswith("C") or ch == "\ufffd":
            continue
        elif _is_punct(ch) or 0x4E00 <= ord(ch) <= 0x9FFF:
            if word:
                out.append("".join(word))
                word = []
            out.append(ch)
        else:
            word.append(ch)
    if word:
        out.append("".join(word))
    return out


class WordPiece:
    """Greedy longest-match-first WordPiece over a ``vocab.txt`` (one token a line)."""

    def __init__(self, vocab: dict[str, int], lower: bool = True, max_chars: int = 100):
        self.vocab, self.lower, self.max_chars = vocab, lower, max_chars
        for t in ("[CLS]", "[SEP]", "[UNK]", "[PAD]"):
            if t not in vocab:
                raise ValueError(f"vocabulary has no {t}")

    @classmethod
    def from_file(cls, path: Path, lower: bool = True) -> "WordPiece":
        lines = path.read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return cls({t: i for i, t in enumerate(lines)}, lower)

    def word(self, w: str) -> list[str]:
        if len(w) > self.max_chars:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(w):
            end = len(w)
            cur = None
            while start < end:
                sub = ("##" if start else "") + w[start:end]
                if sub in self.vocab:
                    cur = sub
                    break
                end -= 1
            if cur is None:
                return ["[UNK]"]
            pieces.append(cur)
            start = end
        return pieces

    def encode(self, text: str, max_len: int) -> list[int]:
        """``[CLS] pieces [SEP]`` ids, truncated to ``max_len`` in all."""
        pieces = [p for w in basic_tokens(text, self.lower) for p in self.word(w)]
        pieces = ["[CLS]"] + pieces[:max_len - 2] + ["[SEP]"]
        return [self.vocab[p] for p in pieces]

    def batch(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, L], mask [B, L]) padded with [PAD] to the longest text."""
        ids = [self.encode(t, max_len) for t in texts]
        width = max(len(i) for i in ids)
        pad = self.vocab["[PAD]"]
        out = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.bool)
        for r, i in enumerate(ids):
            out[r, :len(i)] = torch.tensor(i)
            mask[r, :len(i)] = True
        return out, mask


# --- the encoder ----------------------------------------------------------------------------

class Linear(torch.nn.Module):
    """A float linear (fp32 weight and bias as stored)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = weight.float()
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class BertConfig:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    eps: float = 1e-12

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        c = json.loads(path.read_text())
        if c.get("model_type") not in ("bert", None) or c.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: not a BERT model with GELU (model_type "
                             f"{c.get('model_type')!r}, hidden_act {c.get('hidden_act')!r})")
        if c.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are supported")
        return cls(int(c["hidden_size"]), int(c["num_attention_heads"]),
                   int(c["num_hidden_layers"]), int(c["intermediate_size"]),
                   float(c.get("layer_norm_eps", 1e-12)))


class BertModel(torch.nn.Module):
    """The encoder; ``linears["encoder.{i}.{role}"]`` are its replaceable linears, ``norms`` the
    LayerNorm (weight, bias) pairs that feed them (``encoder.{i}.attn.in`` for qkv, which is the
    embedding LayerNorm for layer 0, and ``encoder.{i}.ffn.in`` for fc1)."""

    def __init__(self, cfg: BertConfig, tensors: dict[str, torch.Tensor], prefix: str = ""):
        super().__init__()
        self.cfg = cfg
        t = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
        self.word = t["embeddings.word_embeddings.weight"]
        self.pos = t["embeddings.position_embeddings.weight"]
        self.type0 = t["embeddings.token_type_embeddings.weight"][0]
        self.norms: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            "encoder.0.attn.in": (t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"])}
        self.linears = torch.nn.ModuleDict()
        for i in range(cfg.layers):
            p = f"encoder.layer.{i}."
            a = p + "attention.self."
            qkv_w = torch.cat([t[a + s + ".weight"] for s in ("query", "key", "value")])
            qkv_b = torch.cat([t[a + s + ".bias"] for s in ("query", "key", "value")])
            self.linears[f"encoder.{i}.attn.qkv".replace(".", "_")] = Linear(qkv_w, qkv_b)
            self.linears[f"encoder.{i}.attn.out".replace(".", "_")] = Linear(
                t[p + "attention.output.dense.weight"], t[p + "attention.output.dense.bias"])
            self.linears[f"encoder.{i}.ffn.fc1".replace(".", "_")] = Linear(
                t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"])
            self.linears[f"encoder.{i}.ffn.fc2".replace(".", "_")] = Linear(
                t[p + "output.dense.weight"], t[p + "output.dense.bias"])
            self.norms[f"encoder.{i}.ffn.in"] = (t[p + "attention.output.LayerNorm.weight"],
                                                 t[p + "attention.output.LayerNorm.bias"])
            self.norms[f"encoder.{i}.out"] = (t[p + "output.LayerNorm.weight"],
                                              t[p + "output.LayerNorm.bias"])
            if i + 1 < cfg.layers:
                self.norms[f"encoder.{i + 1}.attn.in"] = self.norms[f"encoder.{i}.out"]

    def linear(self, key: str) -> torch.nn.Module:
        return self.linears[key.replace(".", "_")]

    def set_linear(self, key: str, module: torch.nn.Module) -> None:
        self.linears[key.replace(".", "_")] = module

    def keys(self) -> list[str]:
        return [f"encoder.{i}.{r}" for i in range(self.cfg.layers) for r in ROLES]

    def _ln(self, x: torch.Tensor, key: str) -> torch.Tensor:
        w, b = self.norms[key]
        return F.layer_norm(x, (x.shape[-1],), w, b, self.cfg.eps)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, hook=None) -> torch.Tensor:
        """Token states [B, L, hidden]; ``hook(key, x_rows)`` sees every linear's input rows
        (real tokens only) before the linear runs."""
        cfg = self.cfg
        b, length = ids.shape
        x = self.word[ids] + self.pos[:length][None] + self.type0
        x = self._ln(x, "encoder.0.attn.in")
        keep = mask.reshape(-1)
        hd = cfg.hidden // cfg.heads
        bias = torch.zeros((b, 1, 1, length))
        bias.masked_fill_(~mask[:, None, None, :], torch.finfo(torch.float32).min)

        def run(key: str, h: torch.Tensor) -> torch.Tensor:
            flat = h.reshape(-1, h.shape[-1])
            if hook is not None:
                hook(key, flat[keep])
            return self.linear(key)(flat).reshape(*h.shape[:-1], -1)

        for i in range(cfg.layers):
            qkv = run(f"encoder.{i}.attn.qkv", x)
            q, k, v = (z.reshape(b, length, cfg.heads, hd).transpose(1, 2)
                       for z in qkv.split(cfg.hidden, dim=-1))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + bias
            ctx = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, length, cfg.hidden)
            x = self._ln(x + run(f"encoder.{i}.attn.out", ctx), f"encoder.{i}.ffn.in")
            h = F.gelu(run(f"encoder.{i}.ffn.fc1", x))
            x = self._ln(x + run(f"encoder.{i}.ffn.fc2", h), f"encoder.{i}.out")
        return x

    def embed(self, ids: torch.Tensor, mask: torch.Tensor, hook=None) -> torch.Tensor:
        """Sentence embeddings: the mean of the real tokens' states, L2-normalized."""
        x = self.forward(ids, mask, hook)
        m = mask[..., None].float()
        return F.normalize((x * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1)


# --- text found on the machine --------------------------------------------------------------

TEXT_ROOTS = ("/usr/share/common-licenses", "/usr/share/doc")


def documents(roots=TEXT_ROOTS, max_files: int = 4000) -> list[Path]:
    """Plain-text files under ``roots`` (licences, copyright files, READMEs), sorted."""
    out = []
    for root in roots:
        r = Path(root)
        if not r.is_dir():
            continue
        for p in sorted(r.rglob("*")):
            if len(out) >= max_files:
                break
            if p.is_file() and not p.is_symlink() and p.suffix in ("", ".txt", ".md") \
                    and p.stat().st_size < 512_000:
                out.append(p)
    return out


def passages(path: Path, min_words: int = 12, max_words: int = 120) -> list[str]:
    """The paragraphs of a text file (blank-line separated), whitespace collapsed, cut to
    ``max_words``; paragraphs shorter than ``min_words`` and binary files give nothing."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    out = []
    for para in text.split("\n\n"):
        words = para.split()
        if len(words) >= min_words:
            out.append(" ".join(words[:max_words]))
    return out


def split_corpus(paths: list[Path], n_cal: int, n_held: int, per_doc: int = 6
                 ) -> tuple[list[str], list[str], int, int]:
    """(calibration passages, held-out passages, documents used for each): documents alternate
    between the two sets in sorted order, so no document feeds both; at most ``per_doc``
    passages a document (many documents, not a few long licences); a passage already taken
    (the same licence text copied into many packages) is skipped."""
    seen: set[str] = set()
    cal: list[str] = []
    held: list[str] = []
    docs = [0, 0]
    for i, p in enumerate(paths):
        dest, side = (cal, 0) if i % 2 == 0 else (held, 1)
        want = n_cal if side == 0 else n_held
        if len(dest) >= want:
            if len(cal) >= n_cal and len(held) >= n_held:
                break
            continue
        took = 0
        for s in passages(p):
            if s in seen or len(dest) >= want or took >= per_doc:
                continue
            seen.add(s)
            dest.append(s)
            took += 1
        docs[side] += took > 0
    return cal, held, docs[0], docs[1]
