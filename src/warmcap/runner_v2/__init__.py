"""Model Runner V2: persistent batch, block tables, slot mappings, attention, sampling."""
