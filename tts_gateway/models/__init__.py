"""Model-side code of the Triton repository: the request contract, repository rendering, backends."""
