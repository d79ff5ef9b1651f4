// PLACEHOLDER: replaced by the reference dense() with skip-softmax and SAGE.
#include "core/check.h"
#include "reference/reference.h"

namespace attnkit::reference {
void dense(const AttentionSpec&, const DenseArgs&, const detail::DenseProblem&) {
  detail::fail("todo");
}
}  // namespace attnkit::reference
