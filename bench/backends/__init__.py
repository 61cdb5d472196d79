"""The real LLM servers the bench and the test suites run beside the proxy: llama.cpp's server on a
tiny GGUF it builds (the default suite's), and vLLM's Python and Rust frontends on a tiny Llama
(opt-in). Each model is built offline; nothing here downloads a model.
"""
