"""Private helpers every room uses: ``tree`` (the one walker of nested data), ``batch`` (cutting
a batch into chunks) and ``text`` (sizes in words, messages, tables)."""
