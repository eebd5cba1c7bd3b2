def test_real_gpt2_token_ids(tokenizer):
    assert tokenizer.encode("The capital of France is") == [464, 3139, 286, 4881, 318]
    assert tokenizer.vocab_size == 50257


def test_token_text_keeps_the_leading_space(tokenizer):
    assert tokenizer.token_text(3139) == " capital"
    assert tokenizer.token_text(464) == "The"
    assert tokenizer.decode([464, 3139, 286, 4881, 318]) == "The capital of France is"
