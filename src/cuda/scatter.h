// scatter_rows: send each received row home, into its owner's combine slot. Launcher only.
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// combine_R[src rank][t*K + k] = rows_MD[m] for m < M (unfused W2 and W13-DGRAD outputs).
void scatter_rows(const Step& s);

}  // namespace epmoe::cuda
