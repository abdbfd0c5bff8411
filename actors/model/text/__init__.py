"""Text in and out of token ids: vocabularies (`vocab`), the SentencePiece and BPE encoders
(`spm`, `bpe`), special tokens (`special`), the tokenizer over them (`tokenizer`), and chat
templates (`chat`), rendered in a counting sandbox (`sandbox`, sized by `template_sizes`)."""
