"""refattn's oracle: golden fixtures, tolerance policy, validation of implementations."""

__all__: list[str] = []
