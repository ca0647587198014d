"""Small helpers shared by moetune's applications (recipe, bench)."""
