"""The sweep file and model catalogue: YAML with line numbers (``yamlfile``), the pydantic schemas
(``sweep``, ``catalogue``), what a variant may not set (``guards``) and expectations that depend
on the build (``expectations``)."""
