"""The corpus, built offline: the shard format (indexed.py), the sources and their units
(sources.py), the tokenizers (tokenizer.py) and the build command (build.py, `python -m corpus`).
Imports errors.py and libraries only: data.py reads what this package writes."""
