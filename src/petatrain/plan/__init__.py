"""Right-sizing: the accelerator catalog, analytic estimates, the recommender and the profiler."""
