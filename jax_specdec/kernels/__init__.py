"""Optional accelerators of one backend, picked by the model code's products
(`jax_specdec.nn.products`). `cpu_matmul`: a product of a few rows with a weight matrix
for XLA:CPU, built from C++ on first use; never imported on GPU or TPU."""
