"""Model recipes: declarative facts about a model family's checkpoint, one JSON file each."""
