"""The text layer: words and keywords, the constraint syntax, occurrence rules, word vectors, prompts and chat templates."""
