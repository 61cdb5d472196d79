"""The configuration: frozen pydantic models validated once at load, errors that name the YAML key,
and the JSON Schema.
"""
