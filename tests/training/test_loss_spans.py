"""Loss rows of rendered chats: the assistant turns, from the row of the last token before each
reply (the first draft after a prefill) to the reply's end (oracle: the default model's own
tokenizer decoding those rows)."""
from __future__ import annotations

from specdeploy.tokenizer import load_tokenizer
from specdeploy.training.data import Conversation, TokenBatches, render_with_loss

REPLIES = ["Hello! How can I help?", "Why did the chicken cross the road?"]
CONV = Conversation("x", [{"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": REPLIES[0]},
                          {"role": "user", "content": "Tell me a joke"},
                          {"role": "assistant", "content": REPLIES[1]}])


def test_spans_cover_exactly_the_replies():
    tok = load_tokenizer(None)
    ids, spans = render_with_loss(tok, CONV, 320)
    assert len(spans) == 2
    for (a, b), reply in zip(spans, REPLIES):
        assert tok.decode(ids[a + 1:b]).strip() == reply + "<|im_end|>"
        assert tok.decode(ids[:a + 1]).endswith("<|im_start|>assistant\n")
    # cut inside the second reply: its span ends at the cut; nothing past it
    cut = spans[1][0] + 3
    ids2, spans2 = render_with_loss(tok, CONV, cut)
    assert spans2 == [spans[0], (spans[1][0], cut)] and ids2 == ids[:cut]


def test_batch_mask_is_the_spans():
    tok = load_tokenizer(None)
    batches = TokenBatches(tok, [CONV], batch_size=1, seq_len=320, min_tokens=1)
    ids, mask = batches.batch(0)
    want, spans = render_with_loss(tok, CONV, 320)
    assert ids[0].tolist() == want
    rows = [i for i in range(len(want)) if any(a <= i < b for a, b in spans)]
    assert mask[0].nonzero().flatten().tolist() == rows
