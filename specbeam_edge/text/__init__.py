"""Text: the tokenizer, prompt formats and chat templates, the terminal chat's input, and the spans a
translation must copy."""
