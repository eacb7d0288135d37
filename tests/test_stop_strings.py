"""`jax_specdec.stop_strings`: the host-side cut of a text at its earliest stop string and
of its tokens at the shortest prefix whose text holds it."""

import pytest

from jax_specdec import stop_strings
from jax_specdec.stop_strings import Stopped, apply, check, cut, token_prefix

# Tokens of a toy vocabulary: several characters each.
VOCAB = {0: "ab", 1: "c", 2: "de", 3: "f\n", 4: "gh"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def test_cut_at_the_earliest_of_several_stops():
    assert cut("one\ntwo END three", ["END", "\n"]) == ("one", "\n")  # earliest, not first
    assert cut("one END two\n", ["\n", "END"]) == ("one ", "END")
    assert cut("abc", ["x", "y"]) == ("abc", None) and cut("abc", []) == ("abc", None)
    assert cut("xabc", ["ab", "abc"]) == ("x", "ab")  # same place: the first listed
    assert cut("END", ["END"]) == ("", "END")


def test_token_prefix_is_the_shortest_holding_the_stop():
    ids = [0, 1, 2, 3, 4]  # "abcdef\ngh"
    assert token_prefix(ids, decode, "cd") == 3  # "c" and "de": the stop spans two tokens
    assert token_prefix(ids, decode, "a") == 1
    assert token_prefix(ids, decode, "\ng") == 5
    assert token_prefix(ids, decode, "e") == 3


def test_apply_cuts_text_tokens_and_reason():
    ids = [0, 1, 2, 3, 4]
    text = decode(ids)
    assert apply(ids, text, "length", ["\n", "cd"], decode) == Stopped(
        [0, 1, 2], "ab", "stop", "cd"
    )
    assert apply(ids, text, "eos", ["zz"], decode) == Stopped(ids, text, "eos", None)
    assert apply(ids, text, "eos", [], decode) == Stopped(ids, text, "eos", None)


@pytest.mark.parametrize(
    "value, message",
    [
        ("", "must not hold an empty string"),
        (["a", ""], "must not hold an empty string"),
        (5, "must be a string or a list of strings"),
        (["a", 3], "must be a string or a list of strings"),
        ({"a": 1}, "must be a string or a list of strings"),
    ],
)
def test_check_refuses_empty_and_non_strings(value, message):
    with pytest.raises(ValueError, match=f"'stop' {message}"):
        check(value, "'stop'")


def test_check_takes_a_string_or_a_list():
    assert check("END", "x") == ("END",) and check(["a", "b"], "x") == ("a", "b")
    assert check(None, "x") == () and stop_strings.check([], "x") == ()


def test_token_sequences_keep_only_those_whose_text_holds_the_stop():
    """A stop whose tokens decode without it (a special token the decoder drops) is left
    to the host, so the program never ends a row the host's cut would not."""

    class Tokenizer:
        ids = {"<end>": [9], "ab": [0], "abc": [0, 1], "": []}

        def encode(self, text, add_special_tokens=False):
            return type("E", (), {"ids": self.ids[text]})()

        def decode(self, ids):
            return "".join(VOCAB.get(i, "") for i in ids)  # id 9 is special: dropped

    tokenizer = Tokenizer()
    assert stop_strings.token_sequences(tokenizer, ["ab", "<end>", "abc", ""]) == ((0,), (0, 1))
