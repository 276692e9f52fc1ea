"""The transaction seam. It knows owners, banks, rows and checks; it knows no model math."""
from hebrus.state.owners import APPENDED, BANKED, OwnerSpec
from hebrus.state.image import Image, Published
from hebrus.state.txn import Transaction

__all__ = ["APPENDED", "BANKED", "OwnerSpec", "Image", "Published", "Transaction"]
