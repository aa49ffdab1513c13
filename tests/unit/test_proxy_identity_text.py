"""Text prompts (``/completion``, ``/v1/completions``) without a client key: which conversation they are."""

from app.proxy.identity import TextPrompts

LONG = "Once upon a time in a land far away, there lived a brave knight who traveled across mountains"


def test_a_prompt_that_continues_the_last_one_is_the_same_conversation():
    t = TextPrompts()
    t.note("a", LONG)
    assert t.find(LONG) == "a"  # sent again as it was
    assert t.find(LONG + " and rivers.") == "a"  # continued
    assert t.find("Another story: " + LONG) is None  # the same words elsewhere are another text
    t.note("b", LONG + " and rivers.")
    assert t.find(LONG + " and rivers. Then") == "b"  # the longest match wins
    assert t.find(LONG + " and seas.") == "a"


def test_a_short_prompt_is_matched_only_when_sent_again_as_it_was():
    t = TextPrompts()
    t.note("h", "Hello")
    assert t.find("Hello") == "h" and t.find("Hello, world") is None
    t.note("e", "")  # an empty prompt is nobody's start
    assert t.find("anything") is None


def test_the_tokens_of_a_prompt_are_kept_until_the_prompt_changes():
    t = TextPrompts()
    t.note("a", LONG)
    t.set_tokens("a", 57)
    assert t.tokens("a") == 57
    t.note("a", LONG)  # the same prompt again: still 57
    assert t.tokens("a") == 57
    t.note("a", LONG + " more")  # a new prompt: its size is the server's to say
    assert t.tokens("a") is None and t.tokens("nobody") is None
    t.forget("a")
    assert t.find(LONG + " more") is None


def test_the_texts_kept_are_bounded_least_recently_used_first_out():
    t = TextPrompts(max_chars=3 * len(LONG))
    for i in range(5):
        t.note(str(i), f"{i} {LONG}")
    assert t.find(f"0 {LONG}") is None and t.find(f"4 {LONG}") == "4"
    t.note("big", "x" * (10 * len(LONG)))  # one text over the bound is kept alone
    assert t.find("x" * (10 * len(LONG))) == "big" and t.find(f"4 {LONG}") is None
