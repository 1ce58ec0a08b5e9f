import { ValidationError, ValidationPipe } from '@nestjs/common';
import { DomainError, FieldError } from './errors.js';

/** Flattens class-validator's tree into `{ field: "filter.attributes", reason }` entries. */
export function flattenValidationErrors(errors: ValidationError[], parent = ''): FieldError[] {
  const out: FieldError[] = [];
  for (const error of errors) {
    const field = parent ? `${parent}.${error.property}` : error.property;
    if (error.constraints) {
      out.push({ field, reason: Object.values(error.constraints).join('; ') });
    }
    if (error.children?.length) out.push(...flattenValidationErrors(error.children, field));
  }
  return out;
}

export function createValidationPipe(): ValidationPipe {
  return new ValidationPipe({
    whitelist: true,
    forbidNonWhitelisted: true,
    forbidUnknownValues: true,
    transform: true,
    validateCustomDecorators: false,
    exceptionFactory: (errors) => DomainError.validation(flattenValidationErrors(errors)),
  });
}
