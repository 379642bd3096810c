#include "collectives/errors.h"

namespace fsdp::collectives {

std::string exception_text(const std::exception& error) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
}

std::string exception_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return exception_text(e);
  } catch (...) {
    return "an exception of unknown type";
  }
}

}  // namespace fsdp::collectives
