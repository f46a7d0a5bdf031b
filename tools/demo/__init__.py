"""The demo model's recipe: scene grammar (`scenes`), captions and tokenizer (`text`), training (`train`), the
preview map fit (`previewfit`), the judge (`judge`) and its evaluations (`evaluate`). See README.md here."""
