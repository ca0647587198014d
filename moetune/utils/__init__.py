"""Small helpers shared by moetune's parts (loading, recipe, bench)."""
