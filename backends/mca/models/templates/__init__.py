"""One declarative template per HF model family; importing a module registers its template."""
