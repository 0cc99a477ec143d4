"""Data files of the embedded prompt set (a package so that wheels ship the JSON files)."""
